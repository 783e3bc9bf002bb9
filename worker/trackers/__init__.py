"""The tracker processes (docs/trackers.md): one per tracker of a job's run, started by the
worker's supervisor (worker/supervisor/trackers.py) beside the training process. Each reads
the job's event stream from Redis and writes its step and eval metrics to one tracker:

    process.py        the loop: read the stream (blocking, from a cursor kept in Redis), log,
                      end once the run is over and its events are read; its failure is its own
    tb_writer.py      TensorBoard event files (tensorboardX), stored in Redis for download
    mlflow_writer.py  an MLflow run (mlflow-skinny's client) at MTQ_MLFLOW_TRACKING_URI
    wandb_writer.py   a wandb run; offline (files under $MTQ_HOME/trackers) without WANDB_API_KEY

Only these modules import a tracker library, each its own, so that neither the training
process nor the supervisor loads one, and a tracker that hangs stalls nothing but itself.
"""

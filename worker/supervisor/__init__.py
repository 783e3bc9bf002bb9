"""The supervisor of `mtq worker`: the process without MLX that takes jobs from rq and watches
the training process that runs them, so that the worker answers whatever the training code does.

    supervisor     the rq worker (`Supervisor`), `run_worker`, and one job's way from dequeue to outcome
    rq_worker      every use of rq's worker internals, checked against the pinned rq version
    admission      whether this worker takes a dequeued job now: memory, gang claims, forming a gang
    child          the handle on the training process, and the first code that process runs
    watchdog       what happens while the child runs a job: death, stall, shutdown, lost lease
    lease          a worker's hold on a running job (its fencing epoch), and Redis retries
    marks          the progress marks and hand-back request shared with the child
    gang_claims    claiming several workers at once for a gang job
    reconciler     repairs what lost workers leave, run by every worker's heartbeat
    kernel_cache   where the child's MLX keeps its compiled kernels
    kernel_share   those kernels shared by a fleet's workers through Redis
    openblas       the system OpenBLAS preload for MLX's CPU matmuls

Nothing here imports MLX or the training side (worker.runtime, worker.kinds, worker.decode):
tests/test_import_graph.py checks every module these reach.
"""

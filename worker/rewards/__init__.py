"""Reward sources of a GRPO job: resolved once at job start, asked for rewards every step.

Where the sources come from (build_scorer):
  1. `JobCreate.reward` if given (see shared/reward_specs.py for every type and option);
  2. else `config.reward_endpoint` if set: the seed server's protocol,
     POST {prompt, completions} -> {rewards}, one request per prompt group;
  3. else the completion's length in characters (the seed server's fallback).

Every source gives one value per completion: a float, or None meaning "does not apply"
(TRL's convention, e.g. exact_match on a prompt item without an `answer`). A completion's
reward is the weighted sum over the sources, a None counting as 0; a completion for which
every source returns None has reward NaN (TRL: unscorable; the trainer leaves it out of its
group's statistics and gives it advantage 0).

Metrics: for each source, `rewards/<name>/mean` and `rewards/<name>/std` (population std)
over the values that apply. When no value of a source applies in a step, both are left
out of that step's metrics: no NaN, and no made-up 0 that would drag a chart down.

Errors a user can fix (a reward endpoint that is down, a reward function that raises or
returns garbage, a module that does not import) are RewardError; the job fails with its
message. Mistakes of the caller (mismatched shapes, missing token counts) are ValueError.

Hostile specs are contained here: regexes run on RE2 (linear time), JSON schemas never
fetch a `$ref`, python functions run only from the operator's allow-list, and a reward
server is reached only at addresses MTQ_REWARD_HOSTS allows (checked on the resolved
address the socket then connects to), within a deadline per call, reading at most
MTQ_MAX_REWARD_RESPONSE_BYTES, and stopping when the job is cancelled.

The package, by part:
  batch.py      a step's completions as the sources see them, a Reward, RewardError
  functions.py  the built-in reward functions (pure: strings in, rewards out)
  sandbox.py    python reward functions: the allow-list, the time limit, the call
  guard.py      the network guard of reward calls (allowed addresses, deadline, cancel)
  endpoint.py   the reward endpoint protocol (per prompt or per step, retries)
  scorer.py     the scorer: the sources bound at job start by their type, summed each step

This package does not import mlx: plain Python, numpy, httpx and jsonschema, so it can be tested
without a model (a reward model's rewards come from the job: worker/runtime/score_requests.py).
"""

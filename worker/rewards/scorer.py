"""The scorer: a job's reward sources, resolved once at job start (build_scorer), asked for a
step's rewards (RewardScorer.score). Each source type has a binder in BINDERS, keyed on the
spec's `type` (shared/reward_specs.py): it does once what can be done once (compile a regex,
import a module) and returns the function that computes the source's flat rewards of a step."""

from typing import Any, Callable

import httpx
import numpy as np
from pydantic import ValidationError

from shared import grader_sandbox, graders
from shared.reward_specs import EndpointReward, LengthReward, compile_regex
from shared.schemas import JobCreate, PromptItem
from shared.settings import Settings, load_settings
from worker.rewards import functions
from worker.rewards.batch import Reward, RewardError, RewardFn, ScoringBatch
from worker.rewards.endpoint import EndpointCaller
from worker.rewards.guard import CallGuard, Resolver, guarded_client, resolve_host
from worker.rewards.sandbox import call_reward_function, load_reward_function, within

# (settings, model_id, adapter_name, prompts, completions) -> rewards: the training process's
# reward models (worker/runtime/score_requests.py reward_model_rewards), given by the job; this package has no MLX.
RewardModelFn = Callable[[Settings, str, str, list[str], list[str]], list[float]]
# How a source waits on another server: Waiting(call) returns call(). The training process's
# runs the call on a helper thread and answers scoring requests meanwhile (worker/runtime/
# training_process.py JobRun.serving_while), so a reward server that asks this service back is answered.
Waiting = Callable[[Callable[[], Any]], Any]


def call_now(call: Callable[[], Any]) -> Any:
    return call()


def bind_length(source, scorer: "RewardScorer") -> RewardFn:
    return lambda b: functions.length_rewards(b.flat_completions(), source.unit, source.target, b.flat_token_counts())


def bind_regex(source, scorer: "RewardScorer") -> RewardFn:
    try:
        pattern = compile_regex(source.pattern)
    except ValueError as e:
        raise RewardError(str(e)) from None
    return lambda b: functions.regex_rewards(b.flat_completions(), pattern, source.mode)


def bind_exact_match(source, scorer: "RewardScorer") -> RewardFn:
    return lambda b: functions.exact_match_rewards(b.flat_completions(), b.flat_field(source.field), source.strip,
                                                   source.case_sensitive)


def bind_contains(source, scorer: "RewardScorer") -> RewardFn:
    return lambda b: functions.contains_rewards(b.flat_completions(), b.flat_field(source.field), source.strip,
                                                source.case_sensitive)


def bind_math_answer(source, scorer: "RewardScorer") -> RewardFn:
    return lambda b: functions.math_answer_rewards(b.flat_completions(), b.flat_field(source.field), source.tolerance)


def bind_json_valid(source, scorer: "RewardScorer") -> RewardFn:
    validator = functions.make_json_validator(source.json_schema)

    def json_valid(b: ScoringBatch) -> list[Reward]:
        # A schema's checks are Python code too (and its `pattern`s Python's backtracking `re`).
        with within(scorer.default_timeout, "json_valid reward"):
            return functions.json_valid_rewards(b.flat_completions(), validator)

    return json_valid


def bind_python(source, scorer: "RewardScorer") -> RewardFn:
    function = load_reward_function(source.function, scorer.settings.reward_modules)
    return lambda b: call_reward_function(
        function, source.function, b.flat_prompts(), b.flat_completions(), b.flat_fields(), scorer.default_timeout)


def bind_endpoint(source, scorer: "RewardScorer") -> RewardFn:
    timeout = source.timeout or scorer.default_timeout
    rewards = EndpointCaller(source, scorer.client(), scorer.guard, timeout, scorer.settings.max_reward_response_bytes).rewards
    return lambda b: scorer.waiting(lambda: rewards(b))


def bind_reward_model(source, scorer: "RewardScorer") -> RewardFn:
    if scorer.reward_model is None:
        raise RewardError("reward_model rewards are computed by a worker's training process")

    def reward_model(b: ScoringBatch) -> list[Reward]:
        prompts = [p if isinstance(p, str) else "\n".join(m["content"] for m in p) for p in b.flat_prompts()]
        return scorer.reward_model(scorer.settings, source.model_id, source.adapter_name, prompts, b.flat_completions())

    return reward_model


def bind_grader(source, scorer: "RewardScorer") -> RewardFn:
    """An OpenAI grader: each completion is its sample, the prompt item's fields its item; a
    sample it cannot score (a missing template variable, a python grader that raised) scores
    0, as OpenAI scores it. score_model graders ask the job's reward models (as reward_model
    sources do)."""
    if graders.uses_python(source.grader) and not scorer.settings.python_graders:
        raise RewardError("python graders are off on this worker (MTQ_PYTHON_GRADERS=1 turns them on)")

    def run_python(code: str, sample: dict, item: dict) -> float:
        return grader_sandbox.run_grader(code, sample, item, scorer.settings.python_grader_timeout_s)[0]

    def judge(model_id: str, adapter_name: str, prompt: str, completion: str) -> float:
        if scorer.reward_model is None:
            raise RewardError("score_model graders are scored by a worker's training process")
        return scorer.reward_model(scorer.settings, model_id, adapter_name, [prompt], [completion])[0]

    def one(completion: str, item: dict) -> float:
        try:
            return graders.score(source.grader, completion, item, run_python, judge)[0]
        except graders.GraderError:
            return 0.0

    def grade(b: ScoringBatch) -> list[Reward]:
        items = b.per_completion([item.model_extra or {} for item in b.items])
        return [one(c, item) for c, item in zip(b.flat_completions(), items)]

    return grade


BINDERS: dict[str, Callable[..., RewardFn]] = {
    "length": bind_length, "regex": bind_regex, "exact_match": bind_exact_match, "contains": bind_contains,
    "math_answer": bind_math_answer, "json_valid": bind_json_valid, "python": bind_python,
    "endpoint": bind_endpoint, "reward_model": bind_reward_model, "grader": bind_grader,
}


def _with_unique_names(sources: list) -> list:
    """Copies of the sources whose metric names are unique: a second 'regex' becomes 'regex_2'."""
    taken: set[str] = set()
    unique = []
    for source in sources:
        name, n = source.metric_name, 1
        while name in taken:
            n += 1
            name = f"{source.metric_name}_{n}"
        taken.add(name)
        unique.append(source if name == source.metric_name else source.model_copy(update={"name": name}))
    return unique


def _check_shapes(items: list, completions: list[list[str]], token_counts: list[list[int]] | None) -> None:
    if not items or len(items) != len(completions):
        raise ValueError(f"need one group of completions per prompt item: {len(items)} items, {len(completions)} groups")
    if token_counts is not None and [len(g) for g in token_counts] != [len(g) for g in completions]:
        raise ValueError("token_counts must have the same shape as completions")
    if len({len(g) for g in completions}) != 1:
        raise ValueError("every group must have the same number of completions")


class RewardScorer:
    """Computes a step's rewards from the job's sources. Close it (or use `with`) when the job ends."""

    def __init__(
        self, sources: list, job_id: str, default_timeout: float = 30.0,
        settings: Settings | None = None, resolver: Resolver = resolve_host, reward_model: RewardModelFn | None = None,
        waiting: Waiting = call_now,
    ):
        self.sources = _with_unique_names(sources)
        self.job_id = job_id
        self.default_timeout = default_timeout
        self.settings = settings or load_settings()
        self.guard = CallGuard(self.settings.reward_hosts, resolver)
        self.reward_model = reward_model
        self.waiting = waiting
        self._client: httpx.Client | None = None
        try:
            self._reward_fns = [BINDERS[s.type](s, self) for s in self.sources]
        except BaseException:
            self.close()
            raise

    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = guarded_client(self.guard)
        return self._client

    def score(
        self, step: int, items: list[PromptItem], completions: list[list[str]],
        *, token_counts: list[list[int]] | None = None, should_stop: Callable[[], bool] = lambda: False,
        whole: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> tuple[np.ndarray, dict[str, float]]:
        """Rewards of shape (B, G) as float32 (weighted sum over sources, None counting as 0;
        NaN where every source returned None) and per-source metrics {"rewards/<name>/mean", "rewards/<name>/std"} over the values
        that apply (left out when none does). token_counts: generated tokens per completion,
        needed by length sources with unit 'tokens'. should_stop: the job's cancel flag,
        looked at while waiting on a reward server (RewardStopped when it is set). whole: a
        gang's rank's (B, G, sources) values as the whole step's (worker/kinds/grpo.py
        whole_batch), so that the metrics are the whole step's."""
        _check_shapes(items, completions, token_counts)
        batch = ScoringBatch(self.job_id, step, items, completions, token_counts, should_stop)
        total = np.zeros(sum(len(g) for g in completions), dtype=np.float64)
        scored = np.zeros(total.shape, dtype=bool)
        values = np.full((len(self.sources), total.size), np.nan)  # each source's, NaN where it returned None
        for i, (source, reward_fn) in enumerate(zip(self.sources, self._reward_fns)):
            returned = reward_fn(batch)
            total += source.weight * np.array([0.0 if v is None else v for v in returned], dtype=np.float64)
            scored |= np.array([v is not None for v in returned])
            values[i] = [np.nan if v is None else v for v in returned]
        if whole is not None:
            values = whole(values.T.reshape(len(completions), -1, len(self.sources))).reshape(-1, len(self.sources)).T
        metrics: dict[str, float] = {}
        for source, applied in zip(self.sources, (v[~np.isnan(v)] for v in values)):
            if applied.size:
                metrics[f"rewards/{source.metric_name}/mean"] = float(np.mean(applied))
                metrics[f"rewards/{source.metric_name}/std"] = float(np.std(applied))
        total[~scored] = np.nan
        return total.reshape(len(completions), -1).astype(np.float32), metrics

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_scorer(spec: JobCreate, job_id: str, settings: Settings | None = None, resolver: Resolver = resolve_host,
                 reward_model: RewardModelFn | None = None, waiting: Waiting = call_now) -> RewardScorer:
    """Resolve the job's reward sources (spec.reward; else config.reward_endpoint; else length
    in characters) and prepare them: python sources are imported here, so that a misspelt
    module fails the job at start with a RewardError naming it. reward_model: how this
    process scores with a reward model (the training process's; needed by reward_model sources).
    waiting: how endpoint sources wait on their server (Waiting)."""
    if spec.reward:
        sources = list(spec.reward)
    elif spec.config.reward_endpoint:
        try:
            sources = [EndpointReward(url=spec.config.reward_endpoint, name="endpoint")]
        except ValidationError:
            raise RewardError(f"config.reward_endpoint {spec.config.reward_endpoint!r} is not a valid http(s) URL") from None
    else:
        sources = [LengthReward(name="length")]
    return RewardScorer(sources, job_id, default_timeout=spec.config.reward_timeout, settings=settings, resolver=resolver,
                        reward_model=reward_model, waiting=waiting)

"""OpenAI's graders (the `grader` of a reinforcement job, and /v1/fine_tuning/alpha/graders):
their models, as the SDK sends them, and their scores, with OpenAI's documented semantics.

    string_check     eq / ne: input == / != reference; like / ilike: input contains reference
                     (ilike: ignoring case). 1.0 or 0.0.
    text_similarity  fuzzy_match: rapidfuzz's WRatio / 100 (default processor); bleu, gleu: NLTK's
                     sentence_bleu / sentence_gleu on whitespace tokens; rouge_1..rouge_5, rouge_l:
                     rouge-score's F-measure (Porter stemmer). cosine and meteor are refused:
                     cosine needs OpenAI's embedding model, meteor NLTK's WordNet data.
    multi            its graders' scores (by name) combined by `calculate_output`, an arithmetic
                     formula read by a parser of its own (+ - * / ^, parentheses, numbers, the
                     graders' names, min max abs floor ceil exp sqrt log): nothing is evaluated.
    python           `grade(sample, item) -> float` (shared/grader_sandbox.py), only where the
                     operator sets MTQ_PYTHON_GRADERS=1.
    score_model      a reward model of this project (a reward job's adapter, `model`:
                     "<model_id>/<adapter_name>") scores the rendered input as prompt and the
                     sample as completion; its score, squashed by a sigmoid into `range`.
    label_model      refused (no generative judge model in this version).

Templates: `{{ sample.output_text }}`, `{{ sample.output_json.key }}`, `{{ item.field.sub }}`,
`{{ item.list.0 }}`; a value that is not a string is written as JSON. A name that is not there
is a GraderError (the sample scores 0; graders/run reports invalid_variable_error).

Pure Python (rapidfuzz, nltk, rouge-score): the API validates and runs graders (graders/run),
the worker scores a reinforcement job's completions (worker/rewards/scorer.py bind_grader).
"""

import ast
import json
import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_TEXT = 100_000  # characters of a template or source


class GraderError(ValueError):
    """A sample the grader cannot score (a missing template variable, a formula's math error)."""

    def __init__(self, message: str, kind: str = "other_error"):
        super().__init__(message)
        self.kind = kind  # the GraderRunResponse metadata.errors flag it sets


class _Grader(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, max_length=128)


class StringCheckGrader(_Grader):
    type: Literal["string_check"]
    input: str = Field(..., max_length=MAX_TEXT)
    reference: str = Field(..., max_length=MAX_TEXT)
    operation: Literal["eq", "ne", "like", "ilike"]


SIMILARITY = ("fuzzy_match", "bleu", "gleu", "meteor", "cosine", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5",
              "rouge_l")
REFUSED_METRICS = {"cosine": "cosine needs OpenAI's embedding model (text-embedding-3-large); use another metric",
                   "meteor": "meteor needs NLTK's WordNet data, which this server does not ship; use another metric"}


class TextSimilarityGrader(_Grader):
    type: Literal["text_similarity"]
    input: str = Field(..., max_length=MAX_TEXT)
    reference: str = Field(..., max_length=MAX_TEXT)
    evaluation_metric: Literal[SIMILARITY]  # type: ignore[valid-type]
    pass_threshold: float | None = None  # evals' field: accepted, not used by a reward

    @field_validator("evaluation_metric")
    @classmethod
    def _available(cls, metric: str) -> str:
        if metric in REFUSED_METRICS:
            raise ValueError(REFUSED_METRICS[metric])
        return metric


class PythonGrader(_Grader):
    type: Literal["python"]
    source: str = Field(..., max_length=MAX_TEXT)
    image_tag: str | None = None

    @field_validator("source")
    @classmethod
    def _defines_grade(cls, source: str) -> str:
        try:
            tree = ast.parse(source)
        except SyntaxError as e:
            raise ValueError(f"python grader source does not parse: {e.msg} (line {e.lineno})") from None
        if not any(isinstance(n, ast.FunctionDef) and n.name == "grade" for n in tree.body):
            raise ValueError("python grader source must define grade(sample, item)")
        return source


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant", "system", "developer"]
    content: str = Field(..., max_length=MAX_TEXT, description="Text (content parts are not supported).")
    type: Literal["message"] | None = None


ADAPTER_REF = re.compile(r"^(?P<model_id>.+)/(?P<adapter_name>[A-Za-z0-9][A-Za-z0-9._-]{0,127})$")


class ScoreModelGrader(_Grader):
    """A reward model trained by a reward job of this project scores the sample: `model` is
    "<model_id>/<adapter_name>" of its adapter; its score s becomes lo + (hi - lo) * sigmoid(s)
    for `range` [lo, hi]. The prompt it scores is the rendered input messages' contents, one per
    line; the completion is sample.output_text."""

    type: Literal["score_model"]
    input: list[InputMessage] = Field(..., max_length=64)
    model: str = Field(..., max_length=700)
    range: list[float] | None = Field(None, min_length=2, max_length=2)
    sampling_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _reward_model(self):
        if not ADAPTER_REF.fullmatch(self.model):
            raise ValueError(f"score_model: model {self.model[:100]!r} must name a reward job's adapter as "
                             "<model_id>/<adapter_name> (this server has no judge model of OpenAI's)")
        lo, hi = self.range or (0.0, 1.0)
        if not lo < hi:
            raise ValueError("score_model: range must be [low, high] with low < high")
        return self

    @property
    def adapter(self) -> tuple[str, str]:
        found = ADAPTER_REF.fullmatch(self.model)
        return found["model_id"], found["adapter_name"]  # type: ignore[index]


class LabelModelGrader(_Grader):
    type: Literal["label_model"]
    input: list[dict[str, Any]]
    model: str
    labels: list[str]
    passing_labels: list[str]

    @model_validator(mode="after")
    def _refused(self):
        raise ValueError("label_model graders need a generative judge model; this version has none (use "
                         "score_model with a reward model, string_check, text_similarity, python or multi)")


SimpleGrader = Annotated[Union[StringCheckGrader, TextSimilarityGrader, PythonGrader, ScoreModelGrader,
                               LabelModelGrader], Field(discriminator="type")]


class MultiGrader(_Grader):
    type: Literal["multi"]
    graders: dict[str, SimpleGrader] = Field(..., min_length=1, max_length=32)
    calculate_output: str = Field(..., min_length=1, max_length=1000)

    @model_validator(mode="before")
    @classmethod
    def _one_grader(cls, data: Any) -> Any:
        # The SDK's type takes one grader as `graders`; OpenAI's docs a name -> grader object.
        if isinstance(data, dict) and isinstance(data.get("graders"), dict) and "type" in data["graders"]:
            one = data["graders"]
            data = {**data, "graders": {one.get("name", "grader"): one}}
        return data

    @model_validator(mode="after")
    def _formula(self):
        parse_formula(self.calculate_output, set(self.graders))
        return self


Grader = Annotated[Union[StringCheckGrader, TextSimilarityGrader, PythonGrader, ScoreModelGrader, LabelModelGrader,
                         MultiGrader], Field(discriminator="type")]


# --------------------------------------------------------------------------- templates

_TEMPLATE = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")


def sample_namespace(output_text: str) -> dict[str, Any]:
    """The `sample` namespace: output_text, and output_json when the text is JSON."""
    try:
        output_json = json.loads(output_text)
    except (ValueError, RecursionError):
        output_json = None
    return {"output_text": output_text, "output_json": output_json}


def render(template: str, sample: dict, item: dict) -> str:
    def value(match: re.Match) -> str:
        path = match.group(1).split(".")
        node: Any = {"sample": sample, "item": item}
        for part in path:
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise GraderError(f"template variable {match.group(1)!r} is not there", "invalid_variable_error")
        return node if isinstance(node, str) else json.dumps(node)

    return _TEMPLATE.sub(value, template)


# --------------------------------------------------------------------------- calculate_output

FUNCTIONS = {"min": min, "max": max, "abs": abs, "floor": math.floor, "ceil": math.ceil, "exp": math.exp,
             "sqrt": math.sqrt, "log": math.log}
OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
             ast.Div: lambda a, b: a / b, ast.Pow: lambda a, b: a ** b}


def parse_formula(formula: str, names: set[str]) -> ast.expr:
    """The formula's syntax tree, every node checked to be arithmetic on numbers, `names` and
    FUNCTIONS (`^` is a power, as OpenAI writes it, read as Python's `**`: above * and /, so
    that 2 * a ^ 2 is 2 * (a ^ 2)). ValueError names what is not allowed."""
    try:
        tree = ast.parse(formula.replace("^", "**"), mode="eval").body
    except SyntaxError:
        raise ValueError(f"calculate_output {formula[:100]!r} does not parse") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp):
            if type(node.op) not in OPERATORS:
                raise ValueError(f"calculate_output: operator {type(node.op).__name__} is not allowed (+ - * / ^)")
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.USub, ast.UAdd)):
                raise ValueError("calculate_output: only - and + as unary operators")
        elif isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS or node.keywords:
                raise ValueError(f"calculate_output: functions are {', '.join(FUNCTIONS)}")
        elif isinstance(node, ast.Name):
            if node.id not in names and node.id not in FUNCTIONS:
                raise ValueError(f"calculate_output: {node.id!r} is not one of the graders ({', '.join(sorted(names))})")
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise ValueError("calculate_output: constants must be numbers")
        elif not isinstance(node, (ast.Load, ast.operator, ast.unaryop)):
            raise ValueError(f"calculate_output: {type(node).__name__} is not allowed")
    return tree


def calculate(tree: ast.expr, scores: dict[str, float]) -> float:
    def ev(node: ast.expr) -> float:
        if isinstance(node, ast.Constant):
            return float(node.value)
        if isinstance(node, ast.Name):
            return scores[node.id]
        if isinstance(node, ast.UnaryOp):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > 1000:
                raise GraderError("calculate_output: exponent larger than 1000", "formula_parse_error")
            return float(OPERATORS[type(node.op)](a, b))
        return float(FUNCTIONS[node.func.id](*(ev(a) for a in node.args)))  # type: ignore[union-attr]

    try:
        value = ev(tree)
    except (ZeroDivisionError, OverflowError, ValueError, TypeError) as e:
        raise GraderError(f"calculate_output: {type(e).__name__}: {e}", "formula_parse_error") from None
    if not math.isfinite(value):
        raise GraderError("calculate_output is not a finite number", "formula_parse_error")
    return value


# --------------------------------------------------------------------------- scores


MAX_SIMILARITY_CHARS = 20_000  # each side; rouge_l's table is words x words, in Python
MAX_LCS_CELLS = 4_000_000


def similarity(metric: str, text: str, reference: str) -> float:
    if max(len(text), len(reference)) > MAX_SIMILARITY_CHARS:
        raise GraderError(f"text_similarity: input and reference are at most {MAX_SIMILARITY_CHARS} characters each")
    if metric == "rouge_l" and len(text.split()) * len(reference.split()) > MAX_LCS_CELLS:
        raise GraderError(f"rouge_l: input words x reference words above {MAX_LCS_CELLS}")
    if metric == "fuzzy_match":
        from rapidfuzz import fuzz, utils

        return fuzz.WRatio(text, reference, processor=utils.default_process) / 100.0
    if metric == "bleu":
        from nltk.translate.bleu_score import sentence_bleu

        return float(sentence_bleu([reference.split()], text.split()))
    if metric == "gleu":
        from nltk.translate.gleu_score import sentence_gleu

        return float(sentence_gleu([reference.split()], text.split()))
    from rouge_score import rouge_scorer

    name = "rougeL" if metric == "rouge_l" else f"rouge{metric[-1]}"
    return float(rouge_scorer.RougeScorer([name], use_stemmer=True).score(reference, text)[name].fmeasure)


def judge_prompt(grader: ScoreModelGrader, sample: dict, item: dict) -> str:
    return "\n".join(render(m.content, sample, item) for m in grader.input)


def in_range(grader: ScoreModelGrader, raw: float) -> float:
    lo, hi = grader.range or (0.0, 1.0)
    return lo + (hi - lo) / (1.0 + math.exp(-max(-500.0, min(500.0, raw))))


def score(grader, output_text: str, item: dict, run_python=None, judge=None) -> tuple[float, dict[str, float]]:
    """(the sample's score, the sub-scores of a multi grader by name). run_python(source,
    sample, item) -> float: how this process runs python graders (None: refused);
    judge(model_id, adapter_name, prompt, completion) -> float: a reward model's score."""
    sample = sample_namespace(output_text)
    if isinstance(grader, StringCheckGrader):
        text, reference = render(grader.input, sample, item), render(grader.reference, sample, item)
        ok = {"eq": text == reference, "ne": text != reference, "like": reference in text,
              "ilike": reference.casefold() in text.casefold()}[grader.operation]
        return (1.0 if ok else 0.0), {}
    if isinstance(grader, TextSimilarityGrader):
        return similarity(grader.evaluation_metric, render(grader.input, sample, item),
                          render(grader.reference, sample, item)), {}
    if isinstance(grader, PythonGrader):
        if run_python is None:
            raise GraderError("python graders are off on this server (MTQ_PYTHON_GRADERS=1 turns them on)",
                              "python_grader_server_error")
        return run_python(grader.source, sample, item), {}
    if isinstance(grader, ScoreModelGrader):
        if judge is None:
            raise GraderError("score_model graders are scored by a worker's reward model", "model_grader_server_error")
        return in_range(grader, judge(*grader.adapter, judge_prompt(grader, sample, item), output_text)), {}
    if isinstance(grader, MultiGrader):
        subs = {name: score(g, output_text, item, run_python, judge)[0] for name, g in grader.graders.items()}
        return calculate(parse_formula(grader.calculate_output, set(subs)), subs), subs
    raise GraderError(f"{grader.type} graders are not available", "other_error")


def parts(grader) -> list:
    """The grader, or a multi grader's graders."""
    return list(grader.graders.values()) if isinstance(grader, MultiGrader) else [grader]


def uses_python(grader) -> bool:
    return any(isinstance(g, PythonGrader) for g in parts(grader))


def reward_models(grader) -> list[tuple[str, str]]:
    """(model_id, adapter_name) of each reward model its score_model graders use."""
    return [g.adapter for g in parts(grader) if isinstance(g, ScoreModelGrader)]

"""The built-in reward functions. Each takes the step's completions as one flat list and
returns one reward per completion, so each can be tested on hand-made strings."""

import json
import math
import numbers
import re
from typing import Any, Callable

import jsonschema
import referencing
import referencing.exceptions

from worker.rewards.batch import Reward, RewardError

def length_rewards(
    completions: list[str], unit: str = "chars", target: int | None = None,
    token_counts: list[int] | None = None,
) -> list[float]:
    """The completion's length in characters or tokens; with a target, -|length - target|."""
    if unit == "tokens":
        if token_counts is None:
            raise ValueError("a length reward in tokens needs token_counts (generated tokens per completion)")
        lengths = token_counts
    else:
        lengths = [len(c) for c in completions]
    if target is None:
        return [float(n) for n in lengths]
    return [-float(abs(n - target)) for n in lengths]


def regex_rewards(completions: list[str], pattern: Any, mode: str = "search") -> list[float]:
    """1.0 where the compiled pattern matches (anywhere, or the whole text for 'fullmatch')."""
    matches = pattern.fullmatch if mode == "fullmatch" else pattern.search
    return [1.0 if matches(c) else 0.0 for c in completions]


def _score_against_references(
    completions: list[str], references: list[Any], score_one: Callable[[str, Any], Reward],
) -> list[Reward]:
    """score_one(completion, reference) for each completion; None where there is no reference."""
    return [None if ref is None else score_one(c, ref) for c, ref in zip(completions, references, strict=True)]


def _normalise_text(text: str, strip: bool, case_sensitive: bool) -> str:
    text = text.strip() if strip else text
    return text if case_sensitive else text.casefold()


def exact_match_rewards(
    completions: list[str], references: list[Any], strip: bool = True, case_sensitive: bool = True,
) -> list[Reward]:
    """1.0 where the completion equals the reference; None where the item has no reference."""
    def score_one(completion: str, reference: Any) -> float:
        same = _normalise_text(completion, strip, case_sensitive) == _normalise_text(str(reference), strip, case_sensitive)
        return 1.0 if same else 0.0

    return _score_against_references(completions, references, score_one)


def contains_rewards(
    completions: list[str], references: list[Any], strip: bool = True, case_sensitive: bool = True,
) -> list[Reward]:
    """1.0 where the completion contains the reference; None where the item has no reference."""
    def score_one(completion: str, reference: Any) -> float:
        needle = _normalise_text(str(reference), strip, case_sensitive)
        return 1.0 if needle in _normalise_text(completion, False, case_sensitive) else 0.0

    return _score_against_references(completions, references, score_one)


# A number as people and LaTeX write it: optional sign, thousands separators, decimals.
# A '-' or '+' right after a word, digit or closing bracket is an operator ("10-3"), not a sign.
_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
_SIGNED = rf"(?:(?<![\w.)}}])[-+\u2212])?{_UNSIGNED}"
_NUMBER_RE = re.compile(
    rf"\\[dt]?frac\s*\{{\s*(?P<frac_num>{_SIGNED})\s*\}}\s*\{{\s*(?P<frac_den>{_SIGNED})\s*\}}"  # \frac{3}{4}
    rf"|(?P<num>{_SIGNED})\s*/\s*(?P<den>{_UNSIGNED})"  # 3/4
    rf"|(?P<value>{_SIGNED})"  # 1,000.5
)
_BOXED_RE = re.compile(r"\\boxed\s*\{")


def _last_boxed_content(text: str) -> str | None:
    """What is inside the last \\boxed{...} (braces may nest); None if there is none or it is unclosed."""
    starts = list(_BOXED_RE.finditer(text))
    if not starts:
        return None
    depth = 1
    begin = starts[-1].end()
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return None


def _to_float(number: str) -> float:
    return float(number.replace(",", "").replace("\u2212", "-"))


def _number_value(match: re.Match) -> float | None:
    if match["frac_num"] is not None:
        numerator, denominator = _to_float(match["frac_num"]), _to_float(match["frac_den"])
    elif match["num"] is not None:
        numerator, denominator = _to_float(match["num"]), _to_float(match["den"])
    else:
        return _to_float(match["value"])
    return None if denominator == 0 else numerator / denominator


def extract_math_answer(text: str) -> float | None:
    """The final answer of a worked solution: the last number inside the last \\boxed{...}
    if there is one, else the last number of the text. None when there is no number.

    Formatting is ignored: '$', '%', thousands separators ('1,000', LaTeX '1{,}000' and
    '1\\,000'), a leading '+', '4.0' vs '4'; '3/4' and '\\frac{3}{4}' are read as 0.75.
    """
    boxed = _last_boxed_content(text)
    text = text if boxed is None else boxed
    text = text.replace("{,}", ",").replace("\\,", "").replace("\\!", "").replace("$", "")
    matches = list(_NUMBER_RE.finditer(text))
    return _number_value(matches[-1]) if matches else None


def _reference_number(reference: Any) -> float | None:
    """The expected answer as a float: a JSON number, or a string read like a completion."""
    if isinstance(reference, bool):
        return None
    if isinstance(reference, numbers.Real):
        return float(reference)
    if isinstance(reference, str):
        return extract_math_answer(reference)
    return None


def math_answer_rewards(completions: list[str], references: list[Any], tolerance: float = 1e-6) -> list[Reward]:
    """1.0 where the completion's final number equals the reference within tolerance, else 0.0
    (also when it has no number). None where the item has no usable numeric reference."""
    def score_one(completion: str, reference: Any) -> Reward:
        expected = _reference_number(reference)
        if expected is None:
            return None
        got = extract_math_answer(completion)
        return 1.0 if got is not None and math.isclose(got, expected, rel_tol=tolerance, abs_tol=tolerance) else 0.0

    return _score_against_references(completions, references, score_one)


_CODE_FENCE_RE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)


def _refuse_retrieval(uri: str):
    raise referencing.exceptions.NoSuchResource(ref=uri)


def make_json_validator(schema: dict | None) -> jsonschema.protocols.Validator | None:
    """A validator for the schema's own draft (checked at submission, see reward_specs).
    Its registry retrieves nothing: a `$ref` resolves only inside the schema, never by
    fetching a URL (jsonschema's default would)."""
    if schema is None:
        return None
    return jsonschema.validators.validator_for(schema)(schema, registry=referencing.Registry(retrieve=_refuse_retrieval))


def json_valid_rewards(completions: list[str], validator: jsonschema.protocols.Validator | None = None) -> list[float]:
    """1.0 where the completion (or its first ``` code fence) is JSON that the validator accepts."""
    def score_one(completion: str) -> float:
        fenced = _CODE_FENCE_RE.search(completion)
        text = fenced.group(1) if fenced else completion
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return 0.0
        try:
            return 1.0 if validator is None or validator.is_valid(value) else 0.0
        except referencing.exceptions.Unresolvable as e:
            raise RewardError(f"json_valid reward: the schema's reference {e.ref!r} does not resolve inside the schema") from None

    return [score_one(c) for c in completions]


"""Rule-based text rewards: normalized exact match and SQuAD-style token F1 against `sample.label`.

Both score the final `\\boxed{...}` answer when the response has one, so a reasoning trace that
ends in a boxed answer is judged by that answer. A sample without a label is an error (a failed
reward under the hub's rule), not a zero: a dataset with no labels is a configuration mistake.
"""

from __future__ import annotations

import re
import string
from collections import Counter

from miles.backends.training_utils.batching.sample import Sample

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_BARE = re.compile(r"\\boxed\s+([^\s$]+)")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, `\\boxed x`) in `text`, braces matched.

    None when there is none, or when the last one is never closed (a truncated response).
    """
    starts = list(_BOXED.finditer(text))
    if not starts:
        bare = _BOXED_BARE.findall(text)
        return bare[-1] if bare else None
    begin = starts[-1].end()
    depth = 1
    for pos in range(begin, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:pos]
    return None


def normalize_exact(text: str) -> str:
    """Strip, casefold and collapse runs of whitespace to one space."""
    return " ".join(text.split()).casefold()


def normalize_squad(text: str) -> str:
    """SQuAD's answer normalization: lowercase, drop punctuation and articles, fix whitespace."""
    text = text.lower().translate(_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 if the two texts are equal after `normalize_exact`, else 0.0."""
    return 1.0 if normalize_exact(prediction) == normalize_exact(gold) else 0.0


def f1_score(prediction: str, gold: str) -> float:
    """SQuAD token F1 between two texts after `normalize_squad`, in [0, 1] and symmetric.

    When either side has no tokens left, SQuAD's rule applies: 1.0 if both are empty, else 0.0.
    """
    pred_tokens = normalize_squad(prediction).split()
    gold_tokens = normalize_squad(gold).split()
    if not pred_tokens or not gold_tokens:
        return 1.0 if pred_tokens == gold_tokens else 0.0
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _require_label(sample: Sample, rm_type: str) -> str:
    if sample.label is None:
        raise ValueError(
            f"sample {sample.index}: --rm-type {rm_type} compares against sample.label, which is "
            "None; give the data source a label column, or choose a reward that needs none"
        )
    # A boxed label (copied from a solution) means its content, like a boxed response.
    return last_boxed(sample.label) or sample.label


def exact_match_reward(sample: Sample) -> float:
    """`--rm-type exact_match`: 1.0 if the response (or its boxed answer) equals the label."""
    gold = _require_label(sample, "exact_match")
    boxed = last_boxed(sample.response)
    if boxed is not None and exact_match(boxed, gold):
        return 1.0
    return exact_match(sample.response, gold)


def f1_reward(sample: Sample) -> float:
    """`--rm-type f1`: token F1 of the response's boxed answer (or the whole response) vs the label."""
    gold = _require_label(sample, "f1")
    boxed = last_boxed(sample.response)
    return f1_score(sample.response if boxed is None else boxed, gold)

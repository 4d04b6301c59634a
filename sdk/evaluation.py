"""Grammar-guided evaluation: how well a model answers a task, with and without
constraints.

Modes (each item runs in every mode that applies to it):

- ``constrained``: greedy generation under the item's constraint (choices, regex,
  JSON Schema or grammar), then exact and normalized match with the answer.
- ``score``: choice items only: every choice is scored as a continuation of the
  prompt (``LLM.score``, summed log-probabilities, or per token with
  ``length_normalize``) and the best one is the answer. No generation.
- ``unconstrained``: greedy free generation with the same prompt, the baseline: its
  output is checked against the item's constraint (invalid rate) and matched the
  same way.

Accuracy comes with a Wilson score interval; the report also has the invalid-output
rate, tokens and time per mode, a confusion matrix per choice set, and every item's
outputs. ``formcast.eval_plot.plot_report`` draws it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from formcast.eval_task import TaskItem, choice_label, load_task, match, parse_output
from formcast.errors import FormcastError

MODES = ("constrained", "score", "unconstrained")
INVALID_LABEL = "(invalid)"


@dataclass(frozen=True, kw_only=True)
class ModeSummary:
    """One mode's results over the items it applies to.

    ``accuracy`` is the normalized match rate, ``exact_accuracy`` the exact one;
    ``ci95`` / ``exact_ci95`` are 95% Wilson score intervals. ``invalid`` counts
    outputs that do not satisfy their item's constraint (failed generations too).
    ``prompt_tokens`` includes the tokens a scoring pass reads.
    """

    items: int
    correct: int
    accuracy: float
    ci95: tuple[float, float]
    exact_correct: int
    exact_accuracy: float
    exact_ci95: tuple[float, float]
    invalid: int
    invalid_rate: float
    prompt_tokens: int
    completion_tokens: int
    time_s: float


@dataclass(frozen=True, kw_only=True)
class EvalReport:
    """What :func:`evaluate` returns; ``to_dict()`` is the JSON report.

    Attributes
    ----------
    modes : dict[str, ModeSummary]
    items : list[dict]
        Per item: id, kind, prompt, answer and, per mode, the output, ``valid``,
        ``exact``, ``correct``, tokens (and the choice scores in ``score`` mode).
    confusion : list[dict]
        Per set of choices: ``labels`` (the choices, then ``"(invalid)"``) and per mode
        a matrix, rows = the answer, columns = the prediction.
    settings : dict
    """

    model: str
    task: str
    num_items: int
    modes: dict[str, ModeSummary]
    items: list[dict[str, Any]]
    confusion: list[dict[str, Any]]
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        from formcast import __version__

        out = asdict(self)
        out["formcast_version"] = __version__
        return out


def wilson_interval(successes: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (pure; (0, 1) when empty)."""
    if total == 0:
        return (0.0, 1.0)
    p = successes / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return (round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4))


def evaluate(llm: Any, task: str | Path | Sequence[Mapping[str, Any]], *,
             modes: Sequence[str] = MODES, max_tokens: int = 48,
             length_normalize: bool = False, batch_size: int = 16,
             progress: Callable[[str, int, int], None] | None = None) -> EvalReport:
    """Evaluate ``llm`` on a task in several modes (no state change besides the engine).

    Parameters
    ----------
    llm : formcast.LLM
    task : JSONL path or list of item dicts
        See ``formcast.eval_task`` for the item format.
    modes : sequence of str
        Any of "constrained", "score", "unconstrained" (default: all).
    max_tokens : int
        For items without their own ``max_tokens``.
    length_normalize : bool
        ``score`` mode ranks choices by mean log-probability per token.
    batch_size : int
        Items per engine batch.
    progress : callable, optional
        ``progress(mode, done, total)`` after each batch or scored item.

    Returns
    -------
    EvalReport

    Raises
    ------
    ValueError
        A malformed task item or an unknown mode.
    ConstraintError
        An item's constraint does not compile.
    """
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    items = load_task(task)
    results: list[dict[str, Any]] = [{} for _ in items]
    summaries: dict[str, ModeSummary] = {}
    for mode in modes:
        todo = [i for i, item in enumerate(items) if mode != "score" or item.kind == "choices"]
        if not todo:
            continue
        report = (lambda done, m=mode, total=len(todo): progress(m, done, total)) \
            if progress else None
        start = time.perf_counter()
        if mode == "score":
            tokens = _run_score(llm, items, todo, results, length_normalize, report)
        else:
            tokens = _run_generate(llm, items, todo, results, mode, max_tokens, batch_size,
                                   report)
        summaries[mode] = _summarize([results[i][mode] for i in todo], tokens,
                                     time.perf_counter() - start)
    rows = [{"id": item.id, "kind": item.kind, "prompt": item.prompt, "answer": item.answer,
             "results": res} for item, res in zip(items, results)]
    return EvalReport(model=getattr(llm.engine, "name", "?"),
                      task=str(task) if isinstance(task, (str, Path)) else "(inline)",
                      num_items=len(items), modes=summaries, items=rows,
                      confusion=_confusion(items, results, list(summaries)),
                      settings={"modes": list(summaries), "max_tokens": max_tokens,
                                "length_normalize": length_normalize, "temperature": 0.0})


def _run_generate(llm: Any, items: list[TaskItem], todo: list[int], results: list[dict],
                  mode: str, max_tokens: int, batch_size: int,
                  report: Callable[[int], None] | None) -> tuple[int, int]:
    """Greedy generation for ``todo`` (constrained or not), batched by shared settings."""
    groups: dict[tuple, list[int]] = {}
    for i in todo:
        item = items[i]
        key = (item.constraint_key if mode == "constrained" else "",
               item.max_tokens or max_tokens, item.system)
        groups.setdefault(key, []).append(i)
    prompt_tokens = completion_tokens = done = 0
    for (_, limit, system), members in groups.items():
        first = items[members[0]]
        constraint = {first.kind: first.constraint} if mode == "constrained" else {}
        for start in range(0, len(members), batch_size):
            chunk = members[start:start + batch_size]
            outs = llm.generate_batch([items[i].prompt for i in chunk], max_tokens=limit,
                                      temperature=0.0, system=system, **constraint)
            for i, out in zip(chunk, outs):
                results[i][mode] = _judge(items[i], out)
                prompt_tokens += results[i][mode]["prompt_tokens"]
                completion_tokens += results[i][mode]["completion_tokens"]
            done += len(chunk)
            if report:
                report(done)
    return prompt_tokens, completion_tokens


def _judge(item: TaskItem, out: Any) -> dict[str, Any]:
    if isinstance(out, FormcastError):
        text = getattr(out, "text", "") or ""
        result = {"output": text, "valid": False, "error": f"{type(out).__name__}: {out}",
                  "prompt_tokens": 0, "completion_tokens": 0}
    else:
        valid, _ = parse_output(item, out.text)
        result = {"output": out.text, "valid": valid,
                  "prompt_tokens": out.usage.prompt_tokens,
                  "completion_tokens": out.usage.completion_tokens}
    # a failed call's partial text answers nothing; free text may still match normalized
    exact, correct = match(item, result["output"]) if "error" not in result else (False, False)
    result.update(exact=exact and result["valid"], correct=correct)
    return result


def _run_score(llm: Any, items: list[TaskItem], todo: list[int], results: list[dict],
               length_normalize: bool, report: Callable[[int], None] | None
               ) -> tuple[int, int]:
    prompt_tokens = 0
    for done, i in enumerate(todo, 1):
        item = items[i]
        logprobs = llm.score(item.prompt, item.constraint, system=item.system)
        lengths = [len(llm.tokenizer.encode(c, add_special_tokens=False))
                   for c in item.constraint]
        ranked = [lp / n for lp, n in zip(logprobs, lengths)] if length_normalize else logprobs
        best = item.constraint[max(range(len(ranked)), key=ranked.__getitem__)]
        base = len(llm.prompt_ids(item.prompt, system=item.system))
        prompt_tokens += sum(base + n for n in lengths)  # one scoring pass per choice
        results[i]["score"] = {"output": best, "valid": True, "exact": best == item.answer,
                               "correct": best == item.answer,
                               "scores": dict(zip(item.constraint,
                                                  (round(s, 4) for s in logprobs))),
                               "prompt_tokens": sum(base + n for n in lengths),
                               "completion_tokens": 0}
        if report:
            report(done)
    return prompt_tokens, 0


def _summarize(rows: list[dict[str, Any]], tokens: tuple[int, int],
               elapsed: float) -> ModeSummary:
    n = len(rows)
    correct = sum(r["correct"] for r in rows)
    exact = sum(r["exact"] for r in rows)
    invalid = sum(not r["valid"] for r in rows)
    return ModeSummary(items=n, correct=correct, accuracy=round(correct / n, 4),
                       ci95=wilson_interval(correct, n), exact_correct=exact,
                       exact_accuracy=round(exact / n, 4), exact_ci95=wilson_interval(exact, n),
                       invalid=invalid, invalid_rate=round(invalid / n, 4),
                       prompt_tokens=tokens[0], completion_tokens=tokens[1],
                       time_s=round(elapsed, 3))


def _confusion(items: list[TaskItem], results: list[dict], modes: list[str]
               ) -> list[dict[str, Any]]:
    """One matrix per distinct choice list and mode: rows answer, columns prediction."""
    sets: dict[tuple[str, ...], list[int]] = {}
    for i, item in enumerate(items):
        if item.kind == "choices":
            sets.setdefault(tuple(item.constraint), []).append(i)
    tables = []
    for choices, members in sets.items():
        labels = [*choices, INVALID_LABEL]
        matrices = {}
        for mode in modes:
            matrix = [[0] * len(labels) for _ in choices]
            for i in members:
                if mode not in results[i]:
                    continue
                predicted = choice_label(items[i], results[i][mode]["output"]) or INVALID_LABEL
                matrix[choices.index(items[i].answer)][labels.index(predicted)] += 1
            matrices[mode] = matrix
        tables.append({"choices": list(choices), "labels": labels, "items": len(members),
                       "matrices": matrices})
    return tables

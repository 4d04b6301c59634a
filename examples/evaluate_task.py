"""Grammar-guided evaluation of SmolLM2 on examples/eval_task.jsonl.

Three modes per item: constrained generation (the answer must satisfy the item's
choices / regex / JSON Schema / grammar), log-prob scoring of the choices, and free
generation as the baseline, whose invalid-output rate shows what the constraints
buy. Writes the JSON report (and a PNG when matplotlib is installed).

Run: python examples/evaluate_task.py [report-folder]
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import formcast

TASK = Path(__file__).with_name("eval_task.jsonl")


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="formcast-"))
    folder.mkdir(parents=True, exist_ok=True)
    llm = formcast.load("smollm2", device="cpu")
    report = formcast.evaluate(llm, TASK)

    print(f"{report.num_items} items from {TASK.name}")
    for mode, m in report.modes.items():
        print(f"  {mode:13s} accuracy {m.accuracy:6.1%} (95% CI {m.ci95[0]:.0%}-{m.ci95[1]:.0%})"
              f"  exact {m.exact_accuracy:6.1%}  invalid {m.invalid_rate:6.1%}"
              f"  ({m.items} items, {m.time_s:.1f} s)")
    data = report.to_dict()
    (folder / "report.json").write_text(json.dumps(data, indent=2) + "\n")
    print(f"report -> {folder / 'report.json'}")
    if importlib.util.find_spec("matplotlib") is not None:
        from formcast.eval_plot import plot_report

        print(f"plot -> {plot_report(data, folder / 'report.png')}")


if __name__ == "__main__":
    main()

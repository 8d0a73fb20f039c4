"""Math datasets from local files in their published layouts → :class:`pepo.tasks.Problem`.

Reads Parquet (``.parquet``), JSON lines (``.jsonl``) or JSON (``.json``, a list of rows), or a
directory of such files (read in sorted order). No hub access: point ``path`` at the files.

| layout | published as | prompt | answer | id |
|---|---|---|---|---|
| ``deepmath`` | zwhe99/DeepMath-103K | ``question`` | ``final_answer`` | ``deepmath-<row>`` |
| ``dapo`` | BytedTsinghua-SIA/DAPO-Math-17k | the problem inside ``prompt[0].content`` (DAPO's "Answer:" instructions removed) | ``reward_model.ground_truth`` | ``extra_info.index`` |
| ``math500`` | HuggingFaceH4/MATH-500 | ``problem`` | ``answer`` | ``unique_id`` |
| ``amc`` | AI-MO/aimo-validation-amc | ``problem`` | ``answer`` (``142.0`` → ``142``) | ``id`` |
| ``aime`` | Maxwell-Jia/AIME_2024, HuggingFaceH4/aime_2024, yentinglin/aime_2025, opencompass/AIME2025, math-ai/aime25 | ``problem`` / ``Problem`` / ``question`` | ``answer`` / ``Answer`` | ``id`` / ``ID`` / row |

``layout="auto"`` picks the layout from the columns. Every prompt is then wrapped in
``template`` (default: the question followed by "Please reason step by step, and put your final
answer within \\boxed{}."), the instruction the paper's evaluation and math-verify's boxed
extraction expect; the model's chat template is applied later, by the tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from pepo.tasks import Problem

__all__ = ["BOXED_TEMPLATE", "LAYOUTS", "load_math_dataset", "read_rows"]

BOXED_TEMPLATE = (
    "{question}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."
)
LAYOUTS = ("auto", "deepmath", "dapo", "math500", "amc", "aime")

_DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
)
_DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".parquet", ".jsonl", ".json"))
        if not files:
            raise ValueError(f"{path} holds no .parquet, .jsonl or .json file")
        return files
    if not path.is_file():
        raise ValueError(f"dataset path {str(path)!r} does not exist")
    return [path]


def read_rows(path: Union[str, Path]) -> list[dict[str, Any]]:
    """All rows of a Parquet / JSONL / JSON file or a directory of them."""
    rows: list[dict[str, Any]] = []
    for f in _files(Path(path)):
        if f.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows.extend(pq.read_table(f).to_pylist())
        elif f.suffix == ".jsonl":
            with open(f) as fh:
                rows.extend(json.loads(line) for line in fh if line.strip())
        else:
            data = json.loads(f.read_text())
            rows.extend(data if isinstance(data, list) else data.get("data", []))
    return rows


def _detect(row: dict[str, Any]) -> str:
    keys = set(row)
    if {"question", "final_answer"} <= keys:
        return "deepmath"
    if {"prompt", "reward_model"} <= keys:
        return "dapo"
    if {"problem", "answer", "unique_id"} <= keys:
        return "math500"
    if {"problem", "answer", "url"} <= keys and "year" not in keys:
        return "amc"
    if keys & {"problem", "Problem", "question"} and keys & {"answer", "Answer"}:
        return "aime"
    raise ValueError(f"cannot tell the dataset layout from the columns {sorted(keys)}")


def _number(x: Any) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x).strip()


def _dapo_problem(content: str) -> str:
    text = content.strip()
    if text.startswith(_DAPO_PREFIX):
        text = text[len(_DAPO_PREFIX) :]
    if text.rstrip().endswith(_DAPO_SUFFIX):
        text = text.rstrip()[: -len(_DAPO_SUFFIX)]
    return text.strip()


def _convert(row: dict[str, Any], layout: str, i: int, name: str) -> tuple[str, str, str]:
    if layout == "deepmath":
        return f"{name}-{i}", row["question"], str(row["final_answer"])
    if layout == "dapo":
        prompt = row["prompt"]
        content = prompt[0]["content"] if isinstance(prompt, list) else str(prompt)
        extra = row.get("extra_info") or {}
        return str(extra.get("index", f"{name}-{i}")), _dapo_problem(content), str(
            row["reward_model"]["ground_truth"]
        )
    if layout == "math500":
        return str(row["unique_id"]), row["problem"], str(row["answer"])
    if layout == "amc":
        return f"{name}-{row.get('id', i)}", row["problem"], _number(row["answer"])
    question = row.get("problem", row.get("Problem", row.get("question")))
    answer = row.get("answer", row.get("Answer"))
    rid = row.get("id", row.get("ID", i))
    return f"{name}-{rid}", question, _number(answer)


def load_math_dataset(
    path: Union[str, Path],
    layout: str = "auto",
    template: Optional[str] = BOXED_TEMPLATE,
    limit: Optional[int] = None,
    name: Optional[str] = None,
) -> list[Problem]:
    """Problems of a local math dataset (see the module docstring for the layouts).

    Args:
        path: a file or a directory of files.
        layout: one of :data:`LAYOUTS`.
        template: ``str.format`` template with ``{question}``; None keeps the question bare.
        limit: keep the first ``limit`` problems.
        name: prefix of generated ids (default: the file or directory name).

    Raises:
        ValueError: unknown layout, missing path, undetectable or missing columns, no rows.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"{path} holds no rows")
    kind = _detect(rows[0]) if layout == "auto" else layout
    name = name or Path(path).stem
    out: list[Problem] = []
    for i, row in enumerate(rows[:limit] if limit else rows):
        try:
            pid, question, answer = _convert(row, kind, i, name)
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(
                f"{path}: row {i} does not have the {kind!r} layout (missing {e}); columns: "
                f"{sorted(row)}"
            ) from None
        prompt = template.format(question=question) if template else question
        out.append(Problem(id=pid, prompt=prompt, answer=answer))
    return out


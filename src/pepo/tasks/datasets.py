"""Math datasets from local files in their published layouts → :class:`pepo.tasks.problems.Problem`.

Reads Parquet (``.parquet``), JSON lines (``.jsonl``) or JSON (``.json``: a list of rows, or
``{"data": [...]}``), or a directory of such files (read in sorted order; compressed or other
table files there are named in a warning, not read). No hub access: point ``path`` at the files.

The layouts, each as ``layout`` (published as): prompt; answer; id:

* ``deepmath`` (zwhe99/DeepMath-103K): ``question``; ``final_answer``; ``<name>-<row>``.
* ``dapo`` (BytedTsinghua-SIA/DAPO-Math-17k): the problem inside the first user message of
  ``prompt`` (``prompt[0]`` in DAPO's file; DAPO's "Answer:" instructions removed);
  ``reward_model.ground_truth``; ``extra_info.index``.
* ``math500`` (HuggingFaceH4/MATH-500): ``problem``; ``answer``; ``unique_id``.
* ``amc`` (AI-MO/aimo-validation-amc): ``problem``; ``answer`` (``142.0`` → ``142``); ``id``.
* ``aime`` (Maxwell-Jia/AIME_2024, HuggingFaceH4/aime_2024, yentinglin/aime_2025,
  opencompass/AIME2025, math-ai/aime25): ``problem`` / ``Problem`` / ``question``; ``answer`` /
  ``Answer``; ``id`` / ``ID`` / row.

Generated ids are ``<name>-<row>``: ``name`` is ``load_math_dataset``'s (default: the file's or
directory's name without its extension) and the row counts over the whole dataset.

``layout="auto"`` picks each file's layout from its columns (an ``answer`` holding a worked
solution, as GSM8K's ``... #### 72``, fits none). A row whose prompt or answer is missing,
null (``None``, NaN) or empty is an error naming its file, row and field (``on_bad_row="skip"``
drops such rows instead, with one warning that counts them): a ``"None"`` gold answer would
score every response 0 without a word. Every prompt is then wrapped in
``template`` (default: the question followed by "Please reason step by step, and put your final
answer within \\boxed{}.", pepo's choice: the paper gives no prompt; math-verify's boxed
extraction reads what it asks for); the model's chat template is applied later, by the
tokenizer.
"""

from __future__ import annotations

import json
import math
import string
import struct
import warnings
from decimal import Decimal
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from pepo.tasks.problems import Problem

__all__ = ["BOXED_TEMPLATE", "LAYOUTS", "ON_BAD_ROW", "load_math_dataset", "missing_path_hint",
           "read_rows"]

BOXED_TEMPLATE = (
    "{question}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."
)
LAYOUTS = ("auto", "deepmath", "dapo", "math500", "amc", "aime")
ON_BAD_ROW = ("error", "skip")

_DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
)
_DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'
_SUFFIXES = (".parquet", ".jsonl", ".json")
# files of a dataset directory that hold data pepo does not read: named in a warning
_UNREAD = (".gz", ".bz2", ".xz", ".zst", ".zip", ".csv", ".tsv", ".arrow", ".txt")


def missing_path_hint(path: Union[str, Path]) -> str:
    """For a data path that does not exist: the data files and folders its directory holds, as
    a clause (``"; its directory holds test.jsonl"``: a publisher's name for the file), or
    ``""``."""
    parent = Path(path).parent
    try:
        near = sorted(p.name for p in parent.iterdir() if not p.name.startswith(".")
                      and (p.suffix.lower() in _SUFFIXES or p.is_dir()))
    except OSError:  # no such directory, or not readable
        return ""
    if not near:
        return ""
    shown = ", ".join(near[:5]) + (f" and {len(near) - 5} more" if len(near) > 5 else "")
    return f"; its directory holds {shown}"


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file())
        files = [p for p in found if p.suffix.lower() in _SUFFIXES]
        unread = [p for p in found if p.suffix.lower() in _UNREAD]
        if unread:
            warnings.warn(f"{path}: {len(unread)} file(s) not read (pepo reads .parquet, .jsonl "
                          f"and .json, uncompressed): {', '.join(p.name for p in unread[:3])}"
                          + (", ..." if len(unread) > 3 else ""), stacklevel=3)
        if not files:
            raise ValueError(f"{path} holds no .parquet, .jsonl or .json file")
        return files
    if not path.is_file():
        raise ValueError(f"dataset path {str(path)!r} does not exist{missing_path_hint(path)}")
    if path.suffix.lower() not in _SUFFIXES:
        raise ValueError(f"{path} is not a .parquet, .jsonl or .json file (it is read by its "
                         f"extension)")
    return [path]


def _object(f: Path, where: str, row: Any) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ValueError(f"{f}: {where} must be a JSON object (one row), got {type(row).__name__}")
    return row


# every column a layout reads (or detects a layout by): what a Parquet file is read for by
# load_math_dataset, so that DeepMath-103K's three long R1 solutions per row stay on disk
_LAYOUT_COLUMNS = frozenset({
    "question", "final_answer", "prompt", "reward_model", "extra_info", "problem", "Problem",
    "answer", "Answer", "unique_id", "url", "year", "id", "ID",
})


def _f32_digits(x: Optional[float]) -> Optional[float]:
    """A float32 value as the shortest decimal that rounds to it (``1e-05``, not the float64 of
    its bits, ``9.999999747378752e-06``, which is no gold answer anyone wrote)."""
    if x is None or not math.isfinite(x):
        return x
    for digits in range(1, 10):  # 9 significant digits always round-trip a float32
        y = float(f"{x:.{digits}g}")
        if struct.unpack("f", struct.pack("f", y))[0] == x:
            return y
    return x


def _file_rows(f: Path, layout_columns: bool = False) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for each row of file ``f``; ``where`` is "row j" (and its JSONL line).
    ``layout_columns``: of a Parquet file, only the columns a layout reads (all of them where
    it has none, so that an error can name them)."""
    if f.suffix.lower() == ".parquet":
        import pyarrow
        import pyarrow.parquet as pq

        try:
            wanted = None
            if layout_columns:
                wanted = [c for c in pq.read_schema(f).names if c in _LAYOUT_COLUMNS] or None
            table = pq.read_table(f, columns=wanted)
        except (pyarrow.ArrowException, OSError) as e:
            raise ValueError(f"{f}: not a readable Parquet file ({e})") from None
        f32 = [x.name for x in table.schema if pyarrow.types.is_float32(x.type)]
        for j, row in enumerate(table.to_pylist()):
            for name in f32:  # a float32 1e-05 reads as 9.999999747378752e-06: its digits
                row[name] = _f32_digits(row[name])
            yield f"row {j}", row
    elif f.suffix.lower() == ".jsonl":
        j = 0
        with open(f, "rb") as fh:  # bytes, so that a bad encoding is reported with its line
            for lineno, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"{f}: line {lineno} is not UTF-8 text ({e.reason} at byte {e.start} of "
                        f"the line)"
                    ) from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{f}: line {lineno} is not valid JSON ({e.msg} at column {e.colno})"
                    ) from None
                yield f"row {j} (line {lineno})", _object(f, f"line {lineno}", row)
                j += 1
    else:
        try:
            text = f.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ValueError(f"{f} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            lines = " (JSON lines, as datasets' to_json writes? name the file .jsonl)" if (
                e.msg == "Extra data" and e.colno == 1) else ""
            raise ValueError(
                f"{f} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}){lines}"
            ) from None
        if isinstance(data, dict) and "data" not in data:
            raise ValueError(
                f"{f} holds one JSON object with keys {sorted(data)[:8]}, not rows: pepo reads "
                f"a JSON list of rows, {{\"data\": [...]}} or JSON lines (.jsonl)"
            )
        rows = data["data"] if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise ValueError(
                f"{f} must hold a JSON list of rows (or {{\"data\": [...]}}), got "
                f"{type(rows).__name__}"
            )
        for j, row in enumerate(rows):
            yield f"row {j}", _object(f, f"row {j}", row)


def _columns(f: Path, row: dict[str, Any]) -> list[str]:
    """A row's columns for an error: a Parquet file's own (its rows hold only the columns a
    layout reads), else the row's."""
    if f.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return sorted(pq.read_schema(f).names)
    return sorted(row)


def _located_rows(path: Union[str, Path], layout_columns: bool = False,
                  ) -> list[tuple[Path, str, dict[str, Any]]]:
    return [(f, where, row) for f in _files(Path(path))
            for where, row in _file_rows(f, layout_columns)]


def read_rows(path: Union[str, Path]) -> list[dict[str, Any]]:
    """All rows of a Parquet / JSONL / JSON file or a directory of them.

    Raises:
        ValueError: a missing path, or a file that cannot be read (not UTF-8, invalid JSON, a
            JSON row that is not an object, unreadable Parquet), naming the file (and line).
    """
    return [row for _, _, row in _located_rows(path)]


def _detect(row: dict[str, Any]) -> Optional[str]:
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
        answer = row.get("answer", row.get("Answer"))
        if isinstance(answer, str) and ("\n" in answer.strip() or "####" in answer):
            return None  # a worked solution (GSM8K's "... #### 72"), not a final answer
        return "aime"
    return None


def _answer(x: Any, field: str) -> str:
    """A gold answer as text: an integral float without its ``.0`` (``142.0`` → ``142``), any
    other finite float in positional notation (``1e-05`` → ``0.00001``), stripped.

    Raises:
        _BadRow: a list, mapping or bool, which is no single answer (``str`` would make
            ``"[1, 2]"`` or ``"True"`` of it), or an infinite float.
    """
    if isinstance(x, (bool, list, tuple, dict)):
        raise _BadRow(field, f"not a single answer ({type(x).__name__})")
    if isinstance(x, float) and math.isinf(x):  # JSON's Infinity, 1e400: no answer a verifier
        raise _BadRow(field, f"not a finite number ({x})")  # can match ("inf" as text)
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    if isinstance(x, float) and math.isfinite(x):  # 1e-05 as 0.00001: math-verify reads 1e-05
        return format(Decimal(repr(x)), "f")  # as 1·e - 5 (Euler's number), so 0.00001 scored 0
    return str(x).strip()


def _dapo_problem(content: str) -> str:
    text = content.strip()
    if text.startswith(_DAPO_PREFIX):
        text = text[len(_DAPO_PREFIX) :]
    if text.rstrip().endswith(_DAPO_SUFFIX):
        text = text.rstrip()[: -len(_DAPO_SUFFIX)]
    return text.strip()


class _BadRow(Exception):
    """A row without a usable value for ``field``."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"field {field!r} is {problem}")
        self.field, self.problem = field, problem


def _null(value: Any) -> Optional[str]:
    """Why ``value`` cannot be a prompt, answer or id, or None when it can."""
    if value is None:
        return "null"
    if isinstance(value, float) and math.isnan(value):  # a null number from pandas / Parquet
        return "null (NaN)"
    if isinstance(value, str) and not value.strip():
        return "empty"
    return None


def _get(container: Any, field: str, *names: Any, text: bool = False) -> Any:
    """The value of the first of ``names`` (default: ``field``) present in ``container``.

    Raises:
        _BadRow: none is present, the value is null or empty, or (``text``) not a string.
    """
    for name in names or (field,):
        try:
            value = container[name]
        except (KeyError, IndexError, TypeError):
            continue
        problem = _null(value)
        if problem is None and text and not isinstance(value, str):
            problem = f"not text ({type(value).__name__})"
        if problem is not None:
            raise _BadRow(field, problem)
        return value
    raise _BadRow(field, "missing")


def _optional_id(row: dict[str, Any], *names: str) -> Optional[Any]:
    """The first non-null of ``names`` in ``row`` (an id that may be absent), or None."""
    for name in names:
        if _null(row.get(name)) is None:
            return row[name]
    return None


def _convert(row: dict[str, Any], layout: str, i: int, name: str) -> tuple[str, str, str]:
    """``(id, question, answer)`` of ``row`` in ``layout``; ``i`` is its index in the dataset.

    Raises:
        _BadRow: a field the layout needs is missing, null or empty.
    """
    if layout == "deepmath":
        return (f"{name}-{i}", _get(row, "question", text=True),
                _answer(_get(row, "final_answer"), "final_answer"))
    if layout == "dapo":
        prompt = _get(row, "prompt")
        if isinstance(prompt, list):  # chat messages: the problem is the first user turn's
            users = [j for j, m in enumerate(prompt)
                     if isinstance(m, dict) and m.get("role") == "user"]
            j = users[0] if users else 0  # DAPO's own file: one user message, prompt[0]
            first = _get(prompt, f"prompt[{j}]", j)
            content = _get(first, f"prompt[{j}].content", "content", text=True)
        else:
            content = _get(row, "prompt", text=True)
        answer = _get(_get(row, "reward_model"), "reward_model.ground_truth", "ground_truth")
        extra = row.get("extra_info")
        index = _optional_id(extra, "index") if isinstance(extra, dict) else None
        pid = str(index) if index is not None else f"{name}-{i}"
        return pid, _dapo_problem(content), _answer(answer, "reward_model.ground_truth")
    if layout == "math500":
        return (str(_get(row, "unique_id")), _get(row, "problem", text=True),
                _answer(_get(row, "answer"), "answer"))
    if layout == "amc":
        rid = _optional_id(row, "id")
        pid = f"{name}-{rid if rid is not None else i}"
        return pid, _get(row, "problem", text=True), _answer(_get(row, "answer"), "answer")
    question = _get(row, "problem", "problem", "Problem", "question", text=True)
    answer = _get(row, "answer", "answer", "Answer")
    rid = _optional_id(row, "id", "ID")
    return f"{name}-{rid if rid is not None else i}", question, _answer(answer, "answer")


def load_math_dataset(
    path: Union[str, Path],
    layout: str = "auto",
    template: Optional[str] = BOXED_TEMPLATE,
    limit: Optional[int] = None,
    name: Optional[str] = None,
    on_bad_row: str = "error",
) -> list[Problem]:
    """Problems of a local math dataset (see the module docstring for the layouts).

    Args:
        path: a file or a directory of files.
        layout: one of :data:`LAYOUTS`.
        template: ``str.format`` template with ``{question}``; None keeps the question bare.
        limit: keep the first ``limit`` problems (int >= 0; None keeps all). Rows after them
            are not checked.
        name: prefix of generated ids (default: the file or directory name).
        on_bad_row: a row whose prompt, answer or id is missing, null or empty: ``"error"``
            raises; ``"skip"`` drops it and warns once with the count.

    A row that repeats an earlier row's question and answer is dropped (one problem per
    question: a dataset that repeats its questions would give SPO several trackers, and its
    offline prior the rollouts, of one question); an id that an earlier, different question
    has is made unique with ``#row<N>`` (its row in the dataset). Each warns once with the
    count.

    Raises:
        ValueError: unknown layout or ``on_bad_row``, a bad ``limit`` or ``template``, missing
            path, an unreadable file (naming it, and the line for JSONL), undetectable columns,
            a bad row (naming its file, row and field), no rows.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    if on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"on_bad_row must be one of {list(ON_BAD_ROW)}, got {on_bad_row!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
    if template is not None:
        fields = {field for _, field, _, _ in string.Formatter().parse(template)} - {None}
        if "question" not in fields:
            raise ValueError(f"template must contain {{question}}, got {template!r}")
        if fields != {"question"}:
            other = sorted(fields - {"question"})[0]
            raise ValueError(
                f"template's only field is {{question}}, got {{{other}}} in {template!r}: write "
                f"a literal brace twice (\\boxed{{{{}}}} for \\boxed{{}})")
    rows = _located_rows(path, layout_columns=True)
    if not rows:
        raise ValueError(f"{path} holds no rows")
    if limit == 0:
        return []
    # each file's layout: with "auto", that of the first of its rows that shows one (a first
    # row with its answer missing must end up reported, or skipped, as a bad row, not as an
    # unknown layout)
    kinds: dict[Path, Optional[str]] = {}
    first: dict[Path, tuple[str, dict[str, Any]]] = {}
    for f, where, row in rows:
        first.setdefault(f, (where, row))
        if kinds.get(f) is None:
            kinds[f] = layout if layout != "auto" else _detect(row)
    for f, kind in kinds.items():
        if kind is None:
            where, row = first[f]
            raise ValueError(
                f"{f}: cannot tell the dataset layout from the columns {_columns(f, row)} of "
                f"{where} (nor of any other row); pass layout= one of {list(LAYOUTS[1:])}"
            )
    name = name or Path(path).stem
    out: list[Problem] = []
    skipped: list[str] = []
    seen: set[tuple[str, str]] = set()  # (prompt, answer): a repeated question is one problem
    ids: set[str] = set()
    repeats, renamed = 0, []
    for i, (f, where, row) in enumerate(rows):
        kind = kinds[f]
        try:
            pid, question, answer = _convert(row, kind, i, name)
        except _BadRow as e:
            what = f"{f}: {where}: {e} for the {kind!r} layout (columns: {_columns(f, row)})"
            if on_bad_row == "error":
                raise ValueError(f"{what}; on_bad_row='skip' drops such rows") from None
            skipped.append(what)
            continue
        prompt = template.format(question=question) if template is not None else question
        if (prompt, answer) in seen:  # once: SPO tracks each question, its prior rolls each
            repeats += 1
            continue
        seen.add((prompt, answer))
        if pid in ids:  # another question's id (files of one directory numbered alike)
            renamed.append(pid)
            pid = f"{pid}#row{i}"
        ids.add(pid)
        out.append(Problem(id=pid, prompt=prompt, answer=answer))
        if limit is not None and len(out) == limit:
            break
    if skipped and not out:
        raise ValueError(
            f"{path}: no usable rows: all {len(skipped)} have a missing, null or empty field "
            f"(first: {skipped[0]})"
        )
    if skipped:
        warnings.warn(
            f"{path}: skipped {len(skipped)} rows with a missing, null or empty field "
            f"(first: {skipped[0]})", stacklevel=2,
        )
    if repeats:
        warnings.warn(f"{path}: {repeats} rows repeat an earlier row's question and answer; "
                      f"each question is one problem ({len(out)} in all)", stacklevel=2)
    if renamed:
        warnings.warn(f"{path}: {len(renamed)} ids name two different questions (first: "
                      f"{renamed[0]!r}); the later ones are made unique with '#row<N>'",
                      stacklevel=2)
    return out

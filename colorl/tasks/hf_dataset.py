"""Problems from a Hugging Face `datasets` source, offline; math answer checking like `jsonl`.

`task.path` is a folder written by `Dataset(Dict).save_to_disk`, a local .json / .jsonl / .parquet
file, or a hub id already in the local `datasets` cache (nothing is downloaded). `task.options`:
`split` (default `train`), `eval_split` (else a seeded `eval_fraction` of the train split, or
`task.eval_path`), `prompt_field` / `answer_field` (default `prompt` / `answer`), or `row_map`:
a `module:function` that maps a row (dict) to `(prompt, answer)`. A prompt that is a list of
{"role", "content"} turns (or, with no prompt field named, a `messages` column) is a conversation
(colorl/tasks/chat.py).

A row without a usable prompt or answer is skipped and counted by index; the task refuses to
start when no row is usable, and `skipped` says how many were left out otherwise.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from colorl.tasks.base import Problem, check_options, register
from colorl.tasks.chat import conversational_problem
from colorl.tasks.jsonl import DatasetError, ListedTask, eval_fraction_option

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
SHOWN_ROWS = 5


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DatasetError("task.name=hf_dataset needs the `datasets` package: pip install 'colorl[datasets]'") from None
    datasets.config.HF_DATASETS_OFFLINE = datasets.config.HF_HUB_OFFLINE = True  # hub ids: local cache only
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def load_split(path: str, split: str):
    """One split of a saved folder, a local file (its only split is `train`) or a cached hub id."""
    datasets = _datasets()
    local = Path(path).expanduser()
    try:
        if local.is_dir():
            loaded = datasets.load_from_disk(str(local))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DatasetError(f"{path}: no split {split!r}; it has {sorted(loaded)}")
                return loaded[split]
            return loaded
        if local.is_file():
            builder = FILE_BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise DatasetError(f"task.path={path!r}: expected a save_to_disk folder or a "
                                   f"{'/'.join(sorted(FILE_BUILDERS))} file")
            return datasets.load_dataset(builder, data_files={split: str(local)}, split=split)
        return datasets.load_dataset(path, split=split)
    except DatasetError:
        raise
    except Exception as exc:  # datasets raises many types for missing, offline or malformed sources
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise DatasetError(f"task.path={path!r} split={split!r}: cannot load ({type(exc).__name__}: {first})") from None


def resolve_row_map(spec: str) -> Callable[[dict], Any]:
    from colorl.user_code import UserCodeError, import_named

    try:
        func = import_named(spec, "function")
    except UserCodeError as exc:
        raise DatasetError(f"task.options.row_map={spec!r}: {exc}") from None
    if not callable(func):
        raise DatasetError(f"task.options.row_map={spec!r}: expected an importable 'module:function'")
    return func


class _Fields:
    """Row -> (prompt, answer) by field names; the reason as a string when the row is unusable. Without
    a prompt field named, a row with no `prompt` but a `messages` list is conversational."""

    def __init__(self, prompt_field: str | None, answer_field: str) -> None:
        self.prompt_field, self.answer_field = prompt_field, answer_field

    def __call__(self, row: dict) -> tuple[Any, Any]:
        prompt_field = self.prompt_field or ("messages" if "prompt" not in row and "messages" in row else "prompt")
        for field in (prompt_field, self.answer_field):
            if field not in row:
                raise KeyError(f"no field {field!r}")
        return row[prompt_field], row[self.answer_field]


def to_problems(rows, mapper: Callable[[dict], Any], where: str) -> tuple[list[Problem], list[tuple[int, str]]]:
    problems, skipped = [], []
    for index, row in enumerate(rows):
        try:
            prompt, answer = mapper(row)
        except Exception as exc:  # a user mapper or a missing field: the row is skipped, by index
            skipped.append((index, f"{type(exc).__name__}: {exc}"))
            continue
        if answer is None or (isinstance(answer, str) and not answer.strip()) or isinstance(answer, (dict, list)):
            skipped.append((index, "missing answer"))
        elif isinstance(prompt, list):  # a conversation: {"role", "content"} turns
            try:
                problems.append(conversational_problem(prompt, "prompt", str(answer)))
            except ValueError as exc:
                skipped.append((index, str(exc)))
        elif not isinstance(prompt, str) or not prompt.strip():
            skipped.append((index, "empty or non-text prompt"))
        else:
            problems.append(Problem(prompt=prompt, answer=str(answer)))
    if not problems:
        reasons = "; ".join(f"row {i}: {why}" for i, why in skipped[:SHOWN_ROWS])
        raise DatasetError(f"{where}: no usable rows ({len(skipped)} skipped; {reasons})")
    return problems, skipped


@register("hf_dataset")
class HFDatasetTask(ListedTask):
    name = "hf_dataset"

    def __init__(self, seed: int, options: dict, path: str, eval_path: str | None = None) -> None:
        opts = check_options(self.name, options, {
            "split": str, "eval_split": str, "prompt_field": str, "answer_field": str, "row_map": str,
            "eval_fraction": float})
        fraction = eval_fraction_option(opts)
        if "row_map" in opts and ({"prompt_field", "answer_field"} & opts.keys()):
            raise DatasetError("task.options: give row_map or prompt_field/answer_field, not both")
        mapper = (resolve_row_map(opts["row_map"]) if "row_map" in opts
                  else _Fields(opts.get("prompt_field"), opts.get("answer_field", "answer")))
        split = opts.get("split", "train")
        problems, self.skipped = to_problems(load_split(path, split), mapper, f"{path} [{split}]")
        eval_problems = None
        if "eval_split" in opts or eval_path:
            eval_split = opts.get("eval_split", "train")
            eval_problems, eval_skipped = to_problems(load_split(eval_path or path, eval_split), mapper,
                                                      f"{eval_path or path} [{eval_split}]")
            self.skipped = self.skipped + eval_skipped
        self.rows = len(problems) + (len(eval_problems) if eval_problems else 0) + len(self.skipped)
        super().__init__(seed, problems, eval_problems, fraction)

    def notes(self) -> list[str]:
        """What the user should hear before the run starts."""
        if not self.skipped:
            return []
        shown = ", ".join(str(i) for i, _ in self.skipped[:SHOWN_ROWS])
        more = ", ..." if len(self.skipped) > SHOWN_ROWS else ""
        return [f"task {self.name}: {len(self.skipped)} of {self.rows} rows skipped (rows {shown}{more}; "
                f"first: {self.skipped[0][1]})"]

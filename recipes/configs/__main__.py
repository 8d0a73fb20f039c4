"""pepo's recipes and configs, the way ``tune ls`` and ``tune cp`` list and copy torchtune's
(which do not know pepo's)::

    python -m pepo.configs ls                  # recipes, and each bundled config's first sentence
    python -m pepo.configs cp tiny my.yaml     # a config to edit; then --config my.yaml

``cp`` never overwrites a file.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from pathlib import Path

RECIPES = {"pepo_recipe": "training (tune run pepo_recipe --config NAME)",
           "pepo_eval": "evaluation (tune run pepo_eval --config NAME)"}


def _summary(path: Path) -> str:
    """The first sentence of the config's opening comment (which may span lines)."""
    words: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.strip("# ") if line.startswith("#") else ""
        if not text:
            if words:
                break
            continue
        words += text.split()
        ends = [i for i, w in enumerate(words) if w.endswith(".")
                and w.strip("(").rstrip(".") not in ("Sec", "App", "Eq", "Fig", "e.g", "i.e")]
        if ends:
            return " ".join(words[: ends[0] + 1]).rstrip(".")
    return " ".join(words).rstrip(".:")


def main(argv: list[str] | None = None) -> int:
    from pepo.training.config import find_config, list_configs

    ap = argparse.ArgumentParser(prog="python -m pepo.configs", description=(
        "pepo's recipes and bundled configs, as tune ls and tune cp list and copy torchtune's: "
        "ls lists them, cp copies one to edit"))
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("ls", help="list the recipes and bundled configs")
    cp = sub.add_parser("cp", help="copy a bundled config to edit")
    cp.add_argument("name", help="a bundled config (python -m pepo.configs ls)")
    cp.add_argument("dest", help="a new .yaml file, or a directory to copy NAME.yaml into")
    args = ap.parse_args(argv)
    if args.command == "ls":
        names = list_configs()
        width = max(map(len, names))
        print("recipes:")
        for recipe, what in RECIPES.items():
            print(f"  {recipe:<12} {what}")
        print("configs:")
        # wrapped on a terminal; a line a config elsewhere (for grep)
        wrap = textwrap.TextWrapper(width=max(60, shutil.get_terminal_size().columns - 1),
                                    subsequent_indent=" " * (width + 4))
        for name in names:
            line = f"  {name:<{width}}  {_summary(Path(find_config(name)))}"
            print(wrap.fill(line) if sys.stdout.isatty() else line)
        return 0
    if args.name not in list_configs():
        print(f"error: no bundled config {args.name!r}; bundled configs: {list_configs()}",
              file=sys.stderr)
        return 2
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / f"{args.name}.yaml"
    if dest.exists():
        print(f"error: {dest} exists; choose a new file name (cp never overwrites)",
              file=sys.stderr)
        return 2
    if not dest.parent.is_dir():
        print(f"error: {dest.parent} is not a directory", file=sys.stderr)
        return 2
    try:
        shutil.copyfile(find_config(args.name), dest)
    except OSError as e:  # a directory it may not write in, a full disk
        print(f"error: cannot write {dest}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"copied {args.name} to {dest}; run it with: tune run "
          f"{'pepo_eval' if args.name.startswith('eval_') else 'pepo_recipe'} --config {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

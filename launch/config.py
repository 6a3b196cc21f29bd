"""Where the Hydra configs are, in a checkout and in an installed package alike.

In a checkout they are the project's top-level conf/, beside launch/. `pip install .` ships the
same files inside the package as launch/conf/ (setup.py maps conf/ there), so an installed
`parallel-train` or `python -m launch.train`, started from any directory, finds them too.

Two mistakes on a command line are refused here, in one line, before Hydra reads it: a preset
that does not exist (`unknown_preset`) and an unquoted element of launch.compare's
compare.overrides (`unquoted_overrides`).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def config_dir() -> Path:
    for candidate in (HERE.parent / "conf", HERE / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"no Hydra configs: neither {HERE.parent / 'conf'} (a checkout) nor {HERE / 'conf'} "
                            "(an installed package) holds config.yaml; reinstall with `pip install .`")


CONFIG_DIR = str(config_dir())
# The directory that holds the `launch` and `parallel` packages: subprocesses get it on their
# PYTHONPATH, so a sweep's runs use this very code wherever they are started.
CODE_ROOT = HERE.parent


def unknown_preset(argv: list[str]) -> str | None:
    """The first `group=name` on the command line that names no preset of conf/<group>/, as one
    line with the choices, or None. Checked before Hydra, whose own report of the same mistake is
    a multi-line traceback-like message (and under torchrun, one per rank)."""
    root = Path(CONFIG_DIR)
    for arg in argv:
        key, sep, value = arg.partition("=")
        group = key.lstrip("+~")
        if not sep or "." in group or not (root / group).is_dir():
            continue
        if not (root / group / f"{value}.yaml").is_file():
            choices = sorted(p.stem for p in (root / group).glob("*.yaml"))
            return f"{group}={value} is not a preset of conf/{group}/: choose one of {', '.join(choices)}"
    return None


def unquoted_overrides(argv: list[str]) -> str | None:
    """The error for a `compare.overrides=[key=value, ...]` whose elements are not quoted (Hydra's
    grammar reads `=` inside a list as a syntax error: "no viable alternative at input"), or None."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+~") != "compare.overrides" or not value.startswith("["):
            continue
        elements, depth, quote, current = [], 0, None, ""
        for ch in value[1:-1] if value.endswith("]") else value[1:]:
            if quote:
                quote = None if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch in "[{(":
                depth += 1
            elif ch in "]})":
                depth -= 1
            elif ch == "," and depth == 0:
                elements.append(current.strip())
                current = ""
                continue
            current += ch
        elements.append(current.strip())
        bare = [e for e in elements if "=" in e and e[:1] not in "'\""]
        if bare:
            quoted = ",".join(f'"{e}"' if e in bare else e for e in elements)
            return (f"{arg}: Hydra cannot read an unquoted key=value inside a list; quote each override: "
                    f"'compare.overrides=[{quoted}]'")
    return None

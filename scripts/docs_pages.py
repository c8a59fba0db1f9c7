"""The documentation site's generated pages and tables (an MkDocs hook, ``hooks:`` in mkdocs.yml).

Nothing here is typed by hand that the code already says:

* the API pages, one per package in :data:`API_PACKAGES`, list every name of the package's
  ``__all__``, read with :mod:`ast` from its ``__init__.py`` (no framework is imported; the
  docstrings are read statically by mkdocstrings' griffe);
* the CLI page renders ``format_help()`` of :func:`unimp.cli.build_parser` and of each
  subcommand (importing ``unimp.cli`` imports no framework);
* ``<!-- gen:NAME -->`` markers in a page are replaced by the tables of :data:`TABLES`
  (recipe names, loss-scale presets, FP8 presets), built from ``unimp``'s framework-free core;
* :func:`docstring_to_markdown` is how the docstrings are read (scripts/docs_griffe.py, a griffe
  extension, calls it): ``Example:`` sections, grouped parameters and Sphinx roles.

``tests/test_docs.py`` calls :func:`api_pages` without MkDocs.
"""

from __future__ import annotations

import ast
import functools
import logging
import pathlib
import re
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: (package, page path under docs/, one line saying what it holds). Each package's ``__all__``
#: is its public surface (STYLE.md: anything not in ``__all__`` is private).
API_PACKAGES: list[tuple[str, str, str]] = [
    ("unimp", "reference/api/unimp.md", "The framework-free core: policies, recipes, loss scales."),
    ("unimp.backends.torch", "reference/api/torch.md", "The PyTorch backend."),
    ("unimp.backends.tensorflow", "reference/api/tensorflow.md",
     "The TensorFlow / Keras 3 (TensorFlow backend) backend."),
    ("unimp.backends.jax", "reference/api/jax.md", "The JAX backend (optax, flax)."),
    ("unimp.keras", "reference/api/keras.md", "Keras 3 on any Keras backend (keras.ops only)."),
    ("unimp.loss_scale", "reference/api/loss_scale.md",
     "Loss-scale configs and the reference loss-scale rule."),
    ("unimp.fp8", "reference/api/fp8.md", "FP8 (float8) scaling rules and presets."),
    ("unimp.blockscale", "reference/api/blockscale.md",
     "Block-scaled formats: MX, block FP8, NVFP4."),
    ("unimp.blockscale_presets", "reference/api/blockscale_presets.md",
     "Each implementation's block-scaled rule as a preset."),
    ("unimp.blockscale_linear", "reference/api/blockscale_linear.md",
     "The block-scaled linear layer's rule: which operand each GEMM quantizes along which axis."),
    ("unimp.blockscale_recipe", "reference/api/blockscale_recipe.md",
     "Which Dense / Linear layers a block-scaled recipe runs in its format."),
]

CLI_PAGE = "reference/cli.md"


def module_file(package: str) -> pathlib.Path:
    """The source file of ``package`` (its ``__init__.py``, or the module's ``.py``)."""
    base = ROOT.joinpath(*package.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def static_all(package: str) -> list[str]:
    """``package.__all__`` read from its source with :mod:`ast` (no import).

    Raises:
        ValueError: the module has no literal ``__all__`` list or tuple of strings.
    """
    tree = ast.parse(module_file(package).read_text(encoding="utf-8"))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            value = ast.literal_eval(node.value)
            if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                return list(value)
    raise ValueError(f"{module_file(package)}: no literal __all__ list of strings")


def _summary(package: str) -> str:
    """The first paragraph of the module's docstring (or an empty string)."""
    doc = ast.get_docstring(ast.parse(module_file(package).read_text(encoding="utf-8"))) or ""
    return doc.split("\n\n", 1)[0].replace("\n", " ").strip()


def api_page(package: str, blurb: str) -> str:
    """The Markdown of one API page: a table of contents and one mkdocstrings block per name."""
    names = sorted(static_all(package), key=lambda n: (n.lower().lstrip("_"), n))
    lines = [
        f"# `{package}`" + " { #" + package + " }",
        "",
        blurb,
        "",
        f"Generated from `{package}.__all__` ({len(names)} names) and the docstrings.",
        "",
        "::: " + package,
        "    options:",
        "      members: false",
        "      show_root_heading: false",
        "      show_root_toc_entry: false",
        "",
    ]
    for name in names:
        lines += [
            f"## `{name}`" + " { #" + f"{package}.{name}" + " }",
            "",
            f"::: {package}.{name}",
            "    options:",
            "      show_root_heading: false",
            "      show_root_toc_entry: false",
            "      heading_level: 3",
            "",
        ]
    return "\n".join(lines)


def api_pages() -> dict[str, str]:
    """Every API page: path under docs/ -> Markdown."""
    pages = {path: api_page(pkg, blurb) for pkg, path, blurb in API_PACKAGES}
    index = ["# API reference", "",
             "One page per public package; each lists its `__all__`, with the docstrings.", "",
             "| package | page | names |", "|---|---|---|"]
    for pkg, path, blurb in API_PACKAGES:
        link = pathlib.PurePosixPath(path).relative_to("reference/api").as_posix()
        index.append(f"| `{pkg}` | [{blurb}]({link}) | {len(static_all(pkg))} |")
    pages["reference/api/index.md"] = "\n".join(index) + "\n"
    return pages


# --- the command line ---------------------------------------------------------------------------


def cli_page() -> str:
    """``unimp --help`` and each subcommand's ``--help``, from the argparse parsers."""
    import argparse
    import os

    from unimp.cli import build_parser

    parser = build_parser()
    subcommands = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subcommands = dict(action.choices)
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width: one width for the page
    try:
        lines = ["# Command line", "",
                 "Generated from the argument parsers (`unimp.cli.build_parser`) while the site "
                 "builds.", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, sub in subcommands.items():
            lines += [f"## `unimp {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join(lines)


# --- tables from the code -----------------------------------------------------------------------


_F32_MAX = 3.4028234663852886e38


def _num(x: float | None) -> str:
    import math

    if x is None:
        return "none"
    if x == _F32_MAX:
        return "float32 max"
    if isinstance(x, float) and x > 0 and math.isfinite(x) and math.log2(x).is_integer():
        return f"2**{int(math.log2(x))}"
    return f"{x:g}" if isinstance(x, float) else str(x)


def loss_scale_presets_table() -> str:
    """``DynamicLossScale.preset(name)`` for every name of ``unimp.loss_scale.presets.PRESETS``."""
    from unimp.loss_scale import DynamicLossScale
    from unimp.loss_scale.presets import PRESETS

    rows = ["| preset | init scale | growth interval | growth / backoff | min / max scale "
            "| hysteresis | overflow tolerance | at the floor |", "|---|---|---|---|---|---|---|---|"]
    for name in PRESETS:
        c = DynamicLossScale.preset(name)
        interval = str(c.growth_interval) + (" (first +1)" if c.delayed_first_growth else "")
        tol = f"{c.overflow_tolerance:g}"
        rows.append(
            f"| `{name}` | {_num(c.init_scale)} | {interval} | {c.growth_factor:g} / "
            f"{c.backoff_factor:g} | {_num(c.min_scale)} / {_num(c.max_scale)} | "
            f"{c.hysteresis} | {tol} | {c.floor_action} |"
        )
    return "\n".join(rows)


def recipes_table() -> str:
    """Every recipe name :func:`unimp.get_recipe` knows, with what it gives."""
    from unimp.policy import policy_names
    from unimp.recipe import _APEX, BLOCK_RECIPES, FP8_RECIPES, get_recipe

    rows = ["| name | params | compute | output | loss scale | cast mode | FP8 / block-scaled |",
            "|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys([*policy_names(), *_APEX, *FP8_RECIPES, *BLOCK_RECIPES]):
        r = get_recipe(name)
        p = r.policy
        ls = r.loss_scale
        scale = ls.kind if ls.kind != "static" else f"static {_num(ls.scale)}"
        fp8 = f"{type(r.fp8.scaling).__name__} `{r.fp8.scaling.rule}`" if r.fp8 is not None else ""
        if r.block is not None:
            fp8 = f"block-scaled `{r.block.rule.name}` (preset `{r.block.rule.preset}`)"
        rows.append(f"| `{name}` | {p.param_dtype} | {p.compute_dtype} | {p.output_dtype} | "
                    f"{scale} | {r.cast_mode} | {fp8} |")
    return "\n".join(rows)


def fp8_presets_table() -> str:
    """``unimp.fp8.fp8_preset(name)`` for every name of ``unimp.fp8.PRESETS``."""
    from unimp.fp8 import PRESETS, fp8_preset

    rows = ["| preset | class | rule | config |", "|---|---|---|---|"]
    for name, (cls, rule) in PRESETS.items():
        cfg = fp8_preset(name)
        rows.append(f"| `{name}` | `{cls.__name__}` | `{rule}` | `{cfg!r}` |")
    return "\n".join(rows)


#: the devices of the support table: (label, kind, NVIDIA compute capability)
DEVICES = (
    ("CPU", "cpu", None), ("TPU", "tpu", None),
    ("GPU, capability unknown (ROCm, ...)", "gpu", None), ("Pascal P100 (6.0)", "gpu", (6, 0)),
    ("Volta V100 (7.0)", "gpu", (7, 0)), ("Turing T4 (7.5)", "gpu", (7, 5)),
    ("Ampere A100 (8.0)", "gpu", (8, 0)), ("Ampere A10 / RTX 30 (8.6)", "gpu", (8, 6)),
    ("Ada L4 / L40 / RTX 40 (8.9)", "gpu", (8, 9)), ("Hopper H100 / H200 (9.0)", "gpu", (9, 0)),
    ("Blackwell B200 (10.0)", "gpu", (10, 0)),
)  # fmt: skip


def devices_table() -> str:
    """:func:`unimp.dtypes.device_support` for each device of :data:`DEVICES`: the one rule
    every backend's ``unimp info`` / ``doctor`` and each framework's native float8 path read."""
    from unimp.dtypes import device_support

    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    rows = ["| device | float16 | bfloat16 | float8 units (native float8 GEMMs: torch, JAX, TensorFlow) "
            "| recommended recipe |", "|---|---|---|---|---|"]
    for label, kind, cc in DEVICES:
        d = device_support(kind, cc)
        rows.append(f"| {label} | {yes(d['float16'])} | {yes(d['bfloat16'])} | {yes(d['float8'])} "
                    f"| `{d['recommended']}` |")
    return "\n".join(rows)


def environment_table() -> str:
    """Every environment variable of :data:`unimp.environment.VARIABLES`."""
    from unimp.environment import VARIABLES

    rows = ["| variable | read (or set) by | values | effect |", "|---|---|---|---|"]
    rows += [f"| `{name}` | {v.used_by} | {v.values} | {v.effect} |" for name, v in VARIABLES.items()]
    return "\n".join(rows)


TABLES: dict[str, Callable[[], str]] = {
    "loss-scale-presets": loss_scale_presets_table,
    "recipes": recipes_table,
    "fp8-presets": fp8_presets_table,
    "devices": devices_table,
    "environment": environment_table,
}

_MARKER = re.compile(r"<!-- gen:([a-z0-9-]+) -->")


def fill_tables(markdown: str) -> str:
    """Replaces each ``<!-- gen:NAME -->`` marker by the table ``TABLES[NAME]`` builds.

    Raises:
        KeyError: a marker names no table.
    """
    return _MARKER.sub(lambda m: TABLES[m.group(1)](), markdown)


# --- docstrings: what griffe's Google parser does not read (scripts/docs_griffe.py) ------------

_EXAMPLE = re.compile(r"(?m)^(\s*)Example:[ \t]*$")
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const):`(~?)([\w.]+)(?:\(\))?`")


@functools.cache
def packages() -> frozenset[str]:
    """The packages with an API page (each page's title is its anchor)."""
    return frozenset(package for package, _, _ in API_PACKAGES)


@functools.cache
def documented() -> frozenset[str]:
    """Every name the generated API pages document, as its anchor ``package.name``."""
    return frozenset(f"{p}.{name}" for p in packages() for name in static_all(p))


def resolve(target: str, module: str) -> tuple[str, str] | None:
    """The documented anchor ``target`` names from ``module``, and the part of it that does
    (``GradScaler.update`` links to ``...GradScaler``); None when it names no documented one."""
    parts = target.split(".")
    scopes = module.split(".")
    bases = [""] + [".".join(scopes[:i]) + "." for i in range(len(scopes), 0, -1)]
    if target in packages():
        return target, target
    for base in ([""] if target.startswith("unimp") else bases):
        for n in range(len(parts), 0, -1):  # a member's name links to its class or module entry
            anchor = base + ".".join(parts[:n])
            if anchor in documented():
                return anchor, ".".join(parts[:n])
    return None


def _role(match: re.Match[str], module: str) -> str:
    short, target = match.group(1), match.group(2)
    text = target.rsplit(".", 1)[-1] if short else target
    found = resolve(target, module)
    return f"[`{text}`][{found[0]}]" if found else f"`{text}`"


_PARAM_SECTION = re.compile(r"^(\s*)(?:Args|Arguments|Parameters|Params|Keyword Args|Other Parameters):\s*$")
_GROUPED = re.compile(r"^(\s*)(\w+(?:\s*,\s*\w+)+)\s*:(.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _continues(lines: list[str], k: int, item_indent: int) -> bool:
    """Whether ``lines[k]`` still belongs to the entry above (deeper, or a blank line inside)."""
    if lines[k].strip():
        return _indent(lines[k]) > item_indent
    return k + 1 < len(lines) and bool(lines[k + 1].strip()) and _indent(lines[k + 1]) > item_indent


def split_grouped_parameters(text: str) -> str:
    """Writes ``a, b: description`` in an ``Args:`` section as one entry per parameter.

    The docstrings document related parameters together; griffe's Google parser reads the
    line as one parameter named ``a, b`` and warns that the signature has none. The first name
    takes the description, each other name points to it. A list of names may run over several
    lines (each but the last ending with a comma).
    """
    lines = text.split("\n")
    out: list[str] = []
    section_indent: int | None = None
    item_indent: int | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        header = _PARAM_SECTION.match(line)
        if header:
            section_indent, item_indent = len(header.group(1)), None
            out.append(line)
            i += 1
            continue
        if section_indent is not None and line.strip():
            if indent <= section_indent:
                section_indent = item_indent = None
            elif item_indent is None:
                item_indent = indent
        if section_indent is not None and item_indent is not None and indent == item_indent:
            joined, j = line, i
            while joined.rstrip().endswith(",") and ":" not in joined and j + 1 < len(lines):
                j += 1
                joined = joined.rstrip() + " " + lines[j].strip()
            grouped = _GROUPED.match(joined)
            if grouped:
                names = [n.strip() for n in grouped.group(2).split(",")]
                out.append(f"{grouped.group(1)}{names[0]}:{grouped.group(3)}")
                k = j + 1
                while k < len(lines) and _continues(lines, k, item_indent):
                    out.append(lines[k])
                    k += 1
                out += [f"{grouped.group(1)}{name}: as ``{names[0]}``." for name in names[1:]]
                i = k
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


_RST_BORDER = re.compile(r"^(\s*)=+(?:\s+=+)+\s*$")


def _cells(line: str, starts: list[int]) -> str:
    """One table row: ``line`` cut at the columns' ``starts``."""
    bounds = [*starts[1:], None]
    return "| " + " | ".join(line[s:e].strip() for s, e in zip(starts, bounds, strict=True)) + " |"


def rst_tables_to_markdown(text: str) -> str:
    """reStructuredText simple tables (``====  ====`` borders, one line per row) as Markdown
    tables; the columns are cut where the border's runs of ``=`` start."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        border = _RST_BORDER.match(lines[i])
        ends = [j for j in range(i + 1, len(lines)) if lines[j].strip() == lines[i].strip()]
        if not border or len(ends) < 2 or any(not lines[j].strip() for j in range(i, ends[1])):
            out.append(lines[i])
            i += 1
            continue
        starts = [m.start() for m in re.finditer(r"=+", lines[i])]
        indent = border.group(1)
        header = [_cells(lines[j], starts) for j in range(i + 1, ends[0])]
        body = [_cells(lines[j], starts) for j in range(ends[0] + 1, ends[1])]
        out += [indent + header[0], indent + "|" + "---|" * len(starts),
                *(indent + row for row in header[1:] + body)]
        i = ends[1] + 1
    return "\n".join(out)


def docstring_to_markdown(text: str, module: str) -> str:
    """``text``, a docstring of an object in ``module``, as griffe should read it: ``Example:``
    as ``Examples:``, grouped parameters one by one, Sphinx roles as links or code, RST simple
    tables as Markdown tables and a paragraph's ``::`` before a literal block as ``:``."""
    text = split_grouped_parameters(_EXAMPLE.sub(r"\1Examples:", text))
    text = re.sub(r"(?m)(\S)::$", r"\1:", rst_tables_to_markdown(text))
    return _ROLE.sub(lambda m: _role(m, module), text)


# --- the MkDocs hooks ---------------------------------------------------------------------------

#: griffe's warnings about docstrings in files whose owners are rewriting them now, as (file,
#: parameter): each is shown as INFO, not counted as a warning, so the build stays strict for
#: everything else. Fix the docstring and delete its line here. GradScaler's torch keywords come
#: through ``**torch_options``: Google style documents them under ``Keyword Args:``, not ``Args:``.
KNOWN_DOCSTRING_WARNINGS: set[tuple[str, str]] = set()

_GRIFFE_PARAM = re.compile(r"^(?:griffe: )?(?P<file>[\w/.]+\.py):\d+: (?:No type or annotation for "
                           r"parameter|Parameter) '(?P<param>[^']+)'")


def known_docstring_warning(message: str) -> bool:
    """Whether griffe's ``message`` is one of :data:`KNOWN_DOCSTRING_WARNINGS`."""
    m = _GRIFFE_PARAM.match(message)
    return bool(m) and (m["file"], m["param"]) in KNOWN_DOCSTRING_WARNINGS


class _KnownWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and known_docstring_warning(record.getMessage()):
            record.msg, record.args = "known, owner to fix: " + record.getMessage(), ()
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def on_config(config):  # noqa: ANN001, ANN201
    """Lowers :data:`KNOWN_DOCSTRING_WARNINGS` to INFO (every other warning fails the build)."""
    logger = logging.getLogger("mkdocs.plugins.griffe")
    if not any(isinstance(f, _KnownWarnings) for f in logger.filters):
        logger.addFilter(_KnownWarnings())
    return config


def on_files(files, config):  # noqa: ANN001, ANN201
    """Adds the generated pages to the site's files."""
    from mkdocs.structure.files import File

    for path, text in {**api_pages(), CLI_PAGE: cli_page()}.items():
        files.append(File.generated(config, path, content=text))
    return files


def on_page_markdown(markdown, page, config, files):  # noqa: ANN001, ANN201
    """Fills the ``<!-- gen:NAME -->`` tables."""
    return fill_tables(markdown)

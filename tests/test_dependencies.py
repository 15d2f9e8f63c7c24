"""Every import is declared in pyproject.toml (.ci/check_imports.py), the checker can fail, and what is declared
for run time only (protobuf) does its job."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path, register: bool = False):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


ci = _load("dduf_ci_check_imports", REPO / ".ci" / "check_imports.py", register=True)


def test_repository_imports_are_declared():
    problems = ci.check(REPO)
    assert not problems, "undeclared imports:\n" + "\n".join(map(str, problems))


# --- the checker itself, on a made-up project --------------------------------------------------------------

PYPROJECT = """
[project]
name = "toy"
dependencies = ["Zlib_NG>=0.4", "torch"]

[project.optional-dependencies]
test = ["pytest>=8", "toy[quanto]"]
quanto = ["optimum-quanto"]
bench = ["matplotlib"]
"""

# module top level -> installed distributions, as importlib.metadata.packages_distributions() gives them
TOP_LEVEL = {
    "zlib_ng": ["zlib-ng"],
    "torch": ["torch"],
    "pytest": ["pytest"],
    "_pytest": ["pytest"],
    "optimum": ["optimum-quanto"],
    "matplotlib": ["matplotlib"],
    "yaml": ["PyYAML"],
}

GROUPS = {"toy": ("core",), "tests": ("core", "test"), "bench": ("core", "bench")}


def _project(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "__init__.py").write_text("")
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def _check(repo: Path, **kwargs) -> list:
    return ci.check(repo, groups=GROUPS, distributions=ci.Distributions(TOP_LEVEL), **kwargs)


def test_undeclared_import_is_reported(tmp_path):
    repo = _project(tmp_path, {"toy/core.py": "import json\n\nimport yaml\n"})
    problems = _check(repo)
    assert [(p.path, p.line, p.module) for p in problems] == [("toy/core.py", 3, "yaml")]
    assert "distribution pyyaml" in str(problems[0]) and "[project].dependencies" in str(problems[0])


def test_declared_stdlib_local_and_relative_imports_pass(tmp_path):
    repo = _project(
        tmp_path,
        {
            "toy/core.py": "import zlib_ng.zlib_ng\nfrom torch import nn\nfrom . import sibling\nimport os, toy\n",
            "toy/sibling.py": "",
            "tests/helpers.py": "",
            "tests/test_a.py": "import pytest\nimport helpers\nfrom toy.core import nn\nimport optimum.quanto\n",
        },
    )
    assert _check(repo) == []  # test -> toy[quanto] is expanded, Zlib_NG matches zlib_ng's zlib-ng


def test_extra_only_distribution_needs_a_guard_in_core(tmp_path):
    repo = _project(
        tmp_path,
        {
            "toy/plain.py": "def f():\n    from optimum.quanto import qint8\n",
            "toy/guarded.py": """
                import importlib
                from typing import TYPE_CHECKING

                try:
                    import matplotlib
                except ImportError:
                    matplotlib = None
                if TYPE_CHECKING:
                    import optimum.quanto

                def f():
                    try:
                        return importlib.import_module("optimum.quanto")
                    except (ModuleNotFoundError, RuntimeError):
                        return None
            """,
        },
    )
    problems = _check(repo)
    assert [(p.path, p.module) for p in problems] == [("toy/plain.py", "optimum.quanto")]
    assert "not guarded" in str(problems[0])


def test_guard_covers_only_the_try_body(tmp_path):
    repo = _project(
        tmp_path,
        {
            "toy/m.py": """
                try:
                    import torch
                except ImportError:
                    import matplotlib
                except ValueError:
                    pass
                try:
                    pass
                except KeyError:
                    import optimum
            """
        },
    )
    assert sorted(p.module for p in _check(repo)) == ["matplotlib", "optimum"]


def test_groups_follow_the_folder(tmp_path):
    repo = _project(
        tmp_path,
        {
            "tests/test_b.py": "import matplotlib\n",  # bench's, not test's
            "bench/run.py": "import matplotlib\nimport pytest\n",  # test's, not bench's
        },
    )
    assert sorted((p.path, p.module) for p in _check(repo)) == [
        ("bench/run.py", "pytest"),
        ("tests/test_b.py", "matplotlib"),
    ]


def test_module_level_importorskip_guards_the_file(tmp_path):
    repo = _project(
        tmp_path,
        {
            "toy/m.py": 'import pytest\npytest.importorskip("optimum.quanto")\nfrom optimum.quanto import q\n',
            "toy/n.py": "def f():\n    import pytest\n    pytest.importorskip('matplotlib')\n\nimport matplotlib\n",
        },
    )
    # toy/m.py: pytest itself is test-only; toy/n.py: the skip is inside a function, the import is not.
    assert sorted((p.path, p.module) for p in _check(repo)) == [
        ("toy/m.py", "pytest"),
        ("toy/n.py", "matplotlib"),
        ("toy/n.py", "pytest"),
    ]


def test_uninstalled_module_is_reported_unless_declared_or_allowed(tmp_path):
    repo = _project(
        tmp_path,
        {
            "toy/a.py": "import not_a_real_module_xyz\n",
            "tests/test_c.py": "import pytest\n",
        },
    )
    problems = _check(repo)
    assert [(p.path, p.module) for p in problems] == [("toy/a.py", "not_a_real_module_xyz")]
    assert "no installed distribution" in str(problems[0])
    allowed = {("toy/a.py", "not_a_real_module_xyz"): "reason"}
    assert _check(repo, allowed_optional=allowed) == []
    # Declared but not installed here (an extra nobody installed): recognised by its name.
    no_quanto = ci.Distributions({k: v for k, v in TOP_LEVEL.items() if k != "optimum"})
    (repo / "tests" / "test_c.py").write_text("import optimum.quanto\n")
    assert ci.check(repo, groups=GROUPS, distributions=no_quanto, allowed_optional=allowed) == []


def test_group_missing_from_pyproject_is_reported(tmp_path):
    repo = _project(tmp_path, {"tools/x.py": "import os\n"})
    problems = ci.check(repo, groups={"tools": ("core", "tools")}, distributions=ci.Distributions(TOP_LEVEL))
    assert len(problems) == 1 and "no dependency group ['tools']" in str(problems[0])


def test_namespace_package_is_told_apart_by_files():
    # google.protobuf lives in the "google" namespace that other distributions share.
    dists = ci.Distributions()
    assert "protobuf" in dists.providers("google.protobuf")
    assert dists.providers("google.protobuf") <= dists.providers("google")


def test_main_exit_code(tmp_path, capsys):
    repo = _project(tmp_path, {"dduf_plus/bad.py": "import yaml_not_installed_anywhere\n"})
    assert ci.main([str(repo)]) == 1
    out = capsys.readouterr()
    assert "dduf_plus/bad.py:1: imports yaml_not_installed_anywhere" in out.out
    (tmp_path / "ok").mkdir()
    assert ci.main([str(_project(tmp_path / "ok", {"dduf_plus/good.py": "import torch\n"}))]) == 0


# --- declared for run time only ----------------------------------------------------------------------------


def test_sentencepiece_model_only_tokenizer_loads(tmp_path):
    """A T5 tokenizer shipped only as spiece.model (no tokenizer.json): transformers converts it through
    protobuf, which nothing imports by name, so only loading one shows that it is declared and installed."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    mf = _load("make_fixtures", REPO / "fixtures" / "make_fixtures.py")
    from transformers import T5Tokenizer

    (tmp_path / "spiece.model").write_bytes(mf.train_sentencepiece_model())
    tok = T5Tokenizer.from_pretrained(tmp_path)
    ids = tok("a photo of a cat").input_ids
    assert ids[-1] == tok.eos_token_id and len(ids) > 2
    assert tok.decode(ids, skip_special_tokens=True) == "a photo of a cat"


def test_protobuf_is_declared_and_installed():
    import importlib.metadata as md

    assert "protobuf" in ci.declared_groups(REPO / "pyproject.toml")["core"]
    md.version("protobuf")  # PackageNotFoundError: this environment was not installed from pyproject.toml

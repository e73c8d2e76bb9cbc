"""pyproject.toml and environment.yml describe the same environment."""

import re
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    text = (ROOT / "environment.yml").read_text()
    listed = set()
    for line in text[text.index("dependencies:"):].splitlines():
        item = line.strip()
        if item.startswith("- ") and not item.endswith(":"):
            listed.add(_name(item[2:]))
    listed -= {"python", "pip", "-e"}
    assert listed == wanted


def test_torch_is_pinned_the_same_in_makefile_and_environment_yml():
    pin = re.search(r"TORCH \?= (torch==[\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert pin in (ROOT / "environment.yml").read_text()

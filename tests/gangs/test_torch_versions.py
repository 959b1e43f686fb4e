"""The one check of the torch versions that private torch APIs are used on, and its switch."""

from __future__ import annotations

import pytest
import torch

from gangs.torch_versions import (
    PRIVATE_APIS_ENV_VAR,
    PRIVATE_APIS_SINCE,
    TESTED_TORCH_VERSIONS,
    private_api_present,
    private_apis_refused,
    private_apis_supported,
    private_path_chosen,
    torch_version_tested,
)


@pytest.mark.parametrize(
    ("version", "tested"),
    [
        ("2.13.0+cpu", True),
        ("2.13.2", True),
        ("2.12.1", True),
        ("2.11.0+cu130", True),
        ("2.11.0a0+git1234", False),
        ("2.10.2", False),
        ("2.14.0.dev20260101", False),
        ("2.14.0", False),
    ],
)
def test_private_apis_are_used_only_on_the_tested_torch_versions(
    version: str, tested: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PRIVATE_APIS_ENV_VAR, raising=False)
    monkeypatch.setattr(torch, "__version__", version)
    assert torch_version_tested(version) is tested
    assert private_apis_supported() is tested


def test_the_tested_versions_are_the_torch_range_of_pyproject() -> None:
    # Every private path (the checkpoints' fast DCP path included) is gated by this range, so it
    # moves with the range the project declares and tests, never on its own.
    import tomllib

    from tests.conftest import REPO_ROOT

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    [torch_spec] = [spec for spec in project["dependencies"] if spec.startswith("torch>")]
    lowest, beyond = TESTED_TORCH_VERSIONS
    assert torch_spec == f"torch>={lowest},<{beyond.removesuffix('.0.dev0')}"


def test_the_running_torch_is_a_tested_one() -> None:
    # pyproject.toml's torch range is the tested one: the suite runs where the private paths do.
    assert torch_version_tested()


@pytest.mark.parametrize(("choice", "private"), [("private", True), ("public", False)])
def test_the_environment_forces_either_path(
    choice: str, private: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PRIVATE_APIS_ENV_VAR, choice)
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    assert private_apis_supported() is private


def test_an_unknown_choice_is_a_clear_error_of_the_callers_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PRIVATE_APIS_ENV_VAR, "fast")
    with pytest.raises(
        ValueError,
        match="TRAINKIT_TORCH_PRIVATE_APIS must be 'private', 'public' or unset, but is 'fast'",
    ):
        private_apis_supported()
    monkeypatch.setenv("SOME_SWITCH", "yes")
    with pytest.raises(KeyError, match="SOME_SWITCH must be 'on', 'public' or unset"):
        private_path_chosen("SOME_SWITCH", private="on", error=KeyError)


def test_the_refusal_names_the_range_and_the_running_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "__version__", "2.15.1")
    assert private_apis_refused() == (
        "used only on torch >=2.11,<2.14.0.dev0 (this is torch 2.15.1, or "
        "TRAINKIT_TORCH_PRIVATE_APIS is 'public')"
    )


@pytest.mark.parametrize(("version", "present"), [("2.13.0+cpu", True), ("2.12.1", False)])
def test_a_private_api_newer_than_the_oldest_tested_torch_is_absent_before_it(
    version: str, present: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "__version__", version)
    assert private_api_present("PyTorchFileReader.get_record_size") is present


@pytest.mark.parametrize("name", sorted(PRIVATE_APIS_SINCE))
def test_each_gated_private_api_is_present_exactly_from_its_version(name: str) -> None:
    # The gate trusts the table's versions, so they must match the running torch.
    owner, attribute = name.rsplit(".", 1)
    assert hasattr(getattr(torch._C, owner), attribute) is private_api_present(name)

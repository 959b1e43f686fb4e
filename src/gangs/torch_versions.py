"""Which torch versions the project's uses of private torch APIs are tested with, and the switch
that chooses between a private path and its public fallback.

Every private API (``torch._C``, ``_``-prefixed names) is used only on the torch versions the
test suite runs (:data:`TESTED_TORCH_VERSIONS`, the range ``pyproject.toml`` allows); on any
other torch the public fallback runs. An environment variable forces either path, which is how
the tests run both on one torch version:

- ``TRAINKIT_TORCH_PRIVATE_APIS`` (``private`` or ``public``): the fused gradient kernels of
  :mod:`runtime.training.gradients`, the flattened HSDP mesh of :mod:`gangs.setup`, the default
  store a collective timeout reports through (:mod:`gangs.gang`), DDP's setter that leaves
  sparse embeddings out (:mod:`runtime.parallel.wrapping`; it has no public path, so the
  public side is a clear error), and the flags a pipeline schedule keeps of its inferred
  shapes, reset for a batch of another shape (:mod:`runtime.parallel.pipeline`; the public side
  refuses such a batch in one line);
- ``TRAINKIT_CHECKPOINT_IO`` (``fast`` or ``public``): the DCP internals of
  :mod:`checkpoint.dcp_io`, kept apart because its two paths differ in speed and in what a
  resume reads, which a run may want to choose on its own.

A private API that the oldest tested torch lacks is listed in :data:`PRIVATE_APIS_SINCE`; the code
using it asks :func:`private_api_present` and takes its fallback where it is absent, rather than
fail mid-run with an AttributeError.
"""

from __future__ import annotations

import os
from typing import Final

import torch

TESTED_TORCH_VERSIONS: Final = ("2.11", "2.14.0.dev0")
"""The torch versions the private paths are tested with: from the first, up to but not the
second (no pre-release of the next minor version). Keep it in step with ``pyproject.toml``."""

PRIVATE_APIS_SINCE: Final = {"PyTorchFileReader.get_record_size": "2.13"}
"""The private APIs (named below ``torch._C``) used on the tested torch versions that came later
than the first of them, each with the torch version that brought it."""

PRIVATE_APIS_ENV_VAR: Final = "TRAINKIT_TORCH_PRIVATE_APIS"
"""``public`` forces the public fallbacks; ``private`` the private APIs (tests); unset chooses
by version."""


def torch_version_tested(version: str | None = None) -> bool:
    """Whether ``version`` (default: the running torch's) is in :data:`TESTED_TORCH_VERSIONS`."""
    lowest, beyond = TESTED_TORCH_VERSIONS
    parsed = torch.torch_version.TorchVersion(torch.__version__ if version is None else version)
    return bool(lowest <= parsed < beyond)


def private_api_present(name: str) -> bool:
    """Whether the running torch has ``name``, a key of :data:`PRIVATE_APIS_SINCE`."""
    since = PRIVATE_APIS_SINCE[name]
    return bool(torch.torch_version.TorchVersion(torch.__version__) >= since)


def private_path_chosen(env_var: str, *, private: str, error: type[Exception] = ValueError) -> bool:
    """Whether to take the private path that ``env_var`` switches: its value ``private`` or
    ``public`` forces one, unset chooses by :func:`torch_version_tested`.

    Read on every call rather than once, so that a test can set the variable for one run;
    another value raises ``error`` (the calling package's own error type).
    """
    choice = os.environ.get(env_var, "")
    if choice not in ("", private, "public"):
        raise error(f"{env_var} must be '{private}', 'public' or unset, but is {choice!r} instead.")
    if choice:
        return choice == private
    return torch_version_tested()


def private_apis_supported() -> bool:
    """Whether the gradient kernels and the HSDP mesh use torch's private APIs
    (:data:`PRIVATE_APIS_ENV_VAR`, else by version)."""
    return private_path_chosen(PRIVATE_APIS_ENV_VAR, private="private")


def private_apis_refused() -> str:
    """Why :func:`private_apis_supported` is false, for the error of a feature with no public
    path."""
    lowest, beyond = TESTED_TORCH_VERSIONS
    return (
        f"used only on torch >={lowest},<{beyond} (this is torch {torch.__version__}, or "
        f"{PRIVATE_APIS_ENV_VAR} is 'public')"
    )

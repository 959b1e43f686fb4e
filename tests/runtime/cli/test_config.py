from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from runtime.cli.config import (
    ConfigError,
    config_from_dict,
    config_help,
    config_keys,
    config_to_dict,
    describe_config,
    dump_config,
    exactly_one_of,
    field_meanings,
    load_config,
    parse_override,
    read_config_file,
)


@dataclass
class GangSection:
    tp_size: int = 1
    timeout_minutes: int = 15

    def validate(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be at least 1, but is {self.tp_size}.")


@dataclass
class OptimSection:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)


@dataclass
class SampleConfig:
    gang: GangSection = field(default_factory=GangSection)
    optim: OptimSection = field(default_factory=OptimSection)
    max_num_steps: int = 200
    amp: bool = False
    name: str = "run"
    data_dir: Path | None = None
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    wandb_project: str | None = None
    layers: list[int] = field(default_factory=list)
    scales: tuple[float, ...] = ()
    weights: dict[str, float] = field(default_factory=dict)
    extra_gang: GangSection | None = None

    def validate(self) -> None:
        if self.max_num_steps % self.gang.tp_size != 0:
            raise ValueError(
                f"max_num_steps ({self.max_num_steps}) must be a multiple of gang.tp_size "
                f"({self.gang.tp_size})."
            )


@dataclass
class TunedDefaultsConfig:
    gang: GangSection = field(default_factory=lambda: GangSection(tp_size=2, timeout_minutes=5))


@dataclass
class RequiredConfig:
    seed: int


def write_yaml(path: Path, data: object) -> Path:
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def error_of(*args: object, **kwargs: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(SampleConfig, *args, **kwargs)  # type: ignore[arg-type]
    return str(info.value)


# ----------------------------------------------------------------------- merge order


def test_defaults_when_nothing_given() -> None:
    assert load_config(SampleConfig) == SampleConfig()


def test_files_override_defaults_and_later_files_win_key_by_key(tmp_path: Path) -> None:
    first = write_yaml(
        tmp_path / "a.yaml", {"gang": {"tp_size": 2, "timeout_minutes": 30}, "max_num_steps": 10}
    )
    second = write_yaml(tmp_path / "b.yaml", {"gang": {"tp_size": 5}})

    config = load_config(SampleConfig, config_files=[first, second])

    # b.yaml replaced only gang.tp_size; a.yaml's timeout and steps survive the merge.
    assert config.gang == GangSection(tp_size=5, timeout_minutes=30)
    assert config.max_num_steps == 10
    assert config.optim == OptimSection()


def test_overrides_apply_after_files_and_in_order(tmp_path: Path) -> None:
    file = write_yaml(tmp_path / "a.yaml", {"max_num_steps": 10, "gang": {"tp_size": 2}})

    config = load_config(
        SampleConfig,
        config_files=[file],
        overrides=["max_num_steps=20", "max_num_steps=30", "gang.timeout_minutes=1"],
    )

    assert config.max_num_steps == 30
    assert config.gang == GangSection(tp_size=2, timeout_minutes=1)


def test_override_of_one_key_keeps_a_section_factory_defaults() -> None:
    config = load_config(TunedDefaultsConfig, overrides=["gang.timeout_minutes=9"])

    assert config.gang == GangSection(tp_size=2, timeout_minutes=9)


def test_override_with_a_mapping_value_merges_into_the_section() -> None:
    config = load_config(SampleConfig, overrides=["gang={timeout_minutes: 7}"])

    assert config.gang == GangSection(tp_size=1, timeout_minutes=7)


def test_optional_section_is_built_from_its_defaults_plus_given_keys() -> None:
    config = load_config(SampleConfig, overrides=["extra_gang.tp_size=4"])

    assert config.extra_gang == GangSection(tp_size=4, timeout_minutes=15)


def test_dict_field_merges_file_and_override_entries(tmp_path: Path) -> None:
    file = write_yaml(tmp_path / "a.yaml", {"weights": {"a": 1, "b": 2.5}})

    config = load_config(SampleConfig, config_files=[file], overrides=["weights.a=0.5"])

    assert config.weights == {"a": 0.5, "b": 2.5}
    assert all(type(v) is float for v in config.weights.values())


def test_config_from_dict_updates_defaults() -> None:
    config = config_from_dict(SampleConfig, {"gang": {"tp_size": 4}, "max_num_steps": 8})

    assert config.gang == GangSection(tp_size=4)
    assert config.max_num_steps == 8


def test_required_field_without_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"'seed' has no default.*--config seed=VALUE"):
        load_config(RequiredConfig)

    assert load_config(RequiredConfig, overrides=["seed=3"]) == RequiredConfig(seed=3)


# ----------------------------------------------------------------------------- types


@pytest.mark.parametrize(
    ("override", "attr", "expected"),
    [
        ("max_num_steps=7", "max_num_steps", 7),
        ("amp=true", "amp", True),
        ("amp=false", "amp", False),
        ("name=hello", "name", "hello"),
        ("name='123'", "name", "123"),
        ("data_dir=/tmp/data", "data_dir", Path("/tmp/data")),
        ("data_dir=null", "data_dir", None),
        ("parallelism=fsdp", "parallelism", "fsdp"),
        ("wandb_project=proj", "wandb_project", "proj"),
        ("wandb_project=null", "wandb_project", None),
        ("layers=[1, 2, 3]", "layers", [1, 2, 3]),
        ("layers=[]", "layers", []),
        ("scales=[1, 2.5]", "scales", (1.0, 2.5)),
        ("weights={x: 1.5}", "weights", {"x": 1.5}),
    ],
)
def test_supported_types(override: str, attr: str, expected: object) -> None:
    value = getattr(load_config(SampleConfig, overrides=[override]), attr)

    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("text", "expected"), [("1e-3", 1e-3), ("2.5e-4", 2.5e-4), ("3", 3.0), ("0.1", 0.1)]
)
def test_float_accepts_ints_and_yaml_1_1_exponent_strings(text: str, expected: float) -> None:
    config = load_config(SampleConfig, overrides=[f"optim.lr={text}"])

    assert config.optim.lr == expected
    assert type(config.optim.lr) is float


def test_fixed_tuple_is_built_from_a_list() -> None:
    config = load_config(SampleConfig, overrides=["optim.betas=[0.8, 1]"])

    assert config.optim.betas == (0.8, 1.0)
    assert type(config.optim.betas) is tuple


def test_fixed_tuple_with_wrong_length_names_expected_length() -> None:
    message = error_of(overrides=["optim.betas=[0.8]"])

    assert "Config key 'optim.betas' expects tuple[float, float] (2 items)" in message
    assert "[0.8] (list) with 1 items" in message


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("max_num_steps=abc", "Config key 'max_num_steps' expects int, but got 'abc' (str)."),
        ("max_num_steps=true", "Config key 'max_num_steps' expects int, but got True (bool)."),
        ("max_num_steps=1.5", "Config key 'max_num_steps' expects int, but got 1.5 (float)."),
        ("optim.lr=fast", "Config key 'optim.lr' expects float, but got 'fast' (str)."),
        ("optim.lr=true", "Config key 'optim.lr' expects float, but got True (bool)."),
        ("amp=1", "Config key 'amp' expects bool, but got 1 (int)."),
        ("name=123", "Config key 'name' expects str, but got 123 (int). Quote the value"),
        ("data_dir=3", "Config key 'data_dir' expects Path or null, but got 3 (int)."),
        (
            "parallelism=dpp",
            "Config key 'parallelism' expects one of 'ddp', 'fsdp', but got 'dpp' (str).",
        ),
        ("layers=3", "Config key 'layers' expects list[int], but got 3 (int)."),
        ("layers=[1, x]", "Config key 'layers[1]' expects int, but got 'x' (str)."),
        ("weights=[1]", "Config key 'weights' expects dict[str, float], but got [1] (list)."),
        ("weights.a=x", "Config key 'weights.a' expects float, but got 'x' (str)."),
        ("gang=3", "Config key 'gang' expects a mapping of GangSection keys, but got 3 (int)."),
        ("gang=null", "Config key 'gang' expects a mapping of GangSection keys, but got None"),
        ("max_num_steps.x=1", "Config key 'max_num_steps' expects int, but got {'x': 1} (dict)."),
    ],
)
def test_wrong_type_names_key_expected_type_and_value(override: str, message: str) -> None:
    assert message in error_of(overrides=[override])


def test_error_says_which_override_set_the_bad_value() -> None:
    message = error_of(overrides=["max_num_steps=abc"])

    assert message.endswith("(from --config max_num_steps=abc)")


def test_error_says_which_file_set_the_bad_value(tmp_path: Path) -> None:
    good = write_yaml(tmp_path / "good.yaml", {"max_num_steps": 4})
    bad = write_yaml(tmp_path / "bad.yaml", {"gang": {"tp_size": "two"}})

    message = error_of(config_files=[good, bad])

    assert "Config key 'gang.tp_size' expects int, but got 'two' (str)." in message
    assert f"(from config file '{bad}')" in message


# ------------------------------------------------------------------------ unknown keys


def test_unknown_nested_key_lists_valid_keys_and_suggests_the_closest() -> None:
    message = error_of(overrides=["gang.tp_sise=2"])

    assert message.startswith(
        "Unknown config key 'gang.tp_sise'. Valid keys under 'gang': tp_size, timeout_minutes. "
        "Did you mean 'gang.tp_size'?"
    )


def test_unknown_top_level_key_from_a_file(tmp_path: Path) -> None:
    file = write_yaml(tmp_path / "a.yaml", {"max_num_step": 3})

    message = error_of(config_files=[file])

    assert "Unknown config key 'max_num_step'. Valid keys at the top level: gang, optim," in message
    assert "Did you mean 'max_num_steps'?" in message
    assert f"(from config file '{file}')" in message


def test_unknown_key_without_a_close_match_has_no_suggestion() -> None:
    message = error_of(overrides=["zzzzzz=1"])

    assert "Unknown config key 'zzzzzz'" in message
    assert "Did you mean" not in message


def test_unknown_section_of_a_deeper_override_names_the_override() -> None:
    message = error_of(overrides=["gnag.tp_size=2"])

    assert "Unknown config key 'gnag'." in message
    assert "Did you mean 'gang'?" in message
    assert "(from --config gnag.tp_size=2)" in message


def test_unknown_key_inside_optional_section_is_reported_precisely() -> None:
    message = error_of(overrides=["extra_gang.tp_sise=2"])

    assert "Unknown config key 'extra_gang.tp_sise'" in message
    assert "Did you mean 'extra_gang.tp_size'?" in message


# -------------------------------------------------------------------------- overrides


@pytest.mark.parametrize("override", ["max_num_steps", "=3", "gang..tp_size=2", ".x=1"])
def test_malformed_override_shows_the_expected_form(override: str) -> None:
    message = error_of(overrides=[override])

    assert f"'{override}'" in message
    assert "gang.tp_size=2" in message


def test_override_value_is_parsed_as_yaml() -> None:
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a=null") == ("a", None)
    assert parse_override("a=x=y") == ("a", "x=y")
    assert parse_override("a=[1, 2]") == ("a", [1, 2])


def test_override_with_invalid_yaml_value() -> None:
    message = error_of(overrides=["layers=[1, 2"])

    assert "Config override 'layers=[1, 2' has a value that is not valid YAML" in message


# ------------------------------------------------------------------------- validate()


def test_validate_hook_of_a_section_becomes_config_error() -> None:
    message = error_of(overrides=["gang.tp_size=0"])

    assert message == "Config section 'gang' is invalid: tp_size must be at least 1, but is 0."


def test_validate_hook_of_the_top_level_becomes_config_error() -> None:
    message = error_of(overrides=["gang.tp_size=3", "max_num_steps=10"])

    assert message == (
        "The config is invalid: max_num_steps (10) must be a multiple of gang.tp_size (3)."
    )


def test_validate_runs_on_optional_sections_too() -> None:
    message = error_of(overrides=["extra_gang.tp_size=-1"])

    assert message.startswith("Config section 'extra_gang' is invalid: tp_size must be at least 1")


def test_validate_passes_for_valid_values() -> None:
    config = load_config(SampleConfig, overrides=["gang.tp_size=4", "max_num_steps=8"])

    assert (config.gang.tp_size, config.max_num_steps) == (4, 8)


# ------------------------------------------------------------------------- file errors


def test_missing_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"

    message = error_of(config_files=[missing])

    assert (
        message == f"Config file '{missing}' does not exist. Check the path given to --config-file."
    )


def test_file_that_does_not_parse_is_named(tmp_path: Path) -> None:
    file = tmp_path / "broken.yaml"
    file.write_text("gang: [1, 2\nmax_num_steps: 3\n", encoding="utf-8")

    message = error_of(config_files=[file])

    assert message.startswith(f"Config file '{file}' is not valid YAML: ")
    assert "\n" not in message


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just a string\n", "3\n"])
def test_file_without_a_top_level_mapping_is_named(tmp_path: Path, text: str) -> None:
    file = tmp_path / "list.yaml"
    file.write_text(text, encoding="utf-8")

    message = error_of(config_files=[file])

    assert message.startswith(f"Config file '{file}' must hold a mapping of config keys")


def test_directory_given_as_file_is_named(tmp_path: Path) -> None:
    message = error_of(config_files=[tmp_path])

    assert message.startswith(f"Config file '{tmp_path}' cannot be read:")


def test_empty_file_is_an_empty_mapping(tmp_path: Path) -> None:
    file = tmp_path / "empty.yaml"
    file.write_text("# nothing here\n", encoding="utf-8")

    assert read_config_file(file) == {}
    assert load_config(SampleConfig, config_files=[file]) == SampleConfig()


def test_yaml_file_is_never_unpickled(tmp_path: Path) -> None:
    file = tmp_path / "evil.yaml"
    file.write_text("max_num_steps: !!python/object/apply:os.getpid []\n", encoding="utf-8")

    assert "is not valid YAML" in error_of(config_files=[file])


# ------------------------------------------------------------------------- round trip


def test_config_to_dict_gives_plain_yaml_types() -> None:
    config = SampleConfig(data_dir=Path("/data"), scales=(1.0, 2.0))

    data = config_to_dict(config)

    assert data["data_dir"] == "/data"
    assert data["scales"] == [1.0, 2.0]
    assert data["optim"] == {"lr": 1e-3, "betas": [0.9, 0.95]}
    assert data["extra_gang"] is None


def test_dump_then_load_gives_an_equal_config(tmp_path: Path) -> None:
    config = load_config(
        SampleConfig,
        overrides=[
            "gang.tp_size=2",
            "optim.lr=2.5e-5",
            "optim.betas=[0.8, 0.99]",
            "max_num_steps=64",
            "amp=true",
            "name='007'",
            "data_dir=/tmp/some data",
            "parallelism=fsdp",
            "wandb_project=null",
            "layers=[4, 8]",
            "scales=[0.5]",
            "weights={'yes': 1.0, '1': 2}",
            "extra_gang.timeout_minutes=3",
        ],
    )
    file = tmp_path / "config.yaml"
    file.write_text(dump_config(config), encoding="utf-8")

    reloaded = load_config(SampleConfig, config_files=[file])

    assert reloaded == config
    assert reloaded.name == "007"
    assert reloaded.weights == {"yes": 1.0, "1": 2.0}
    assert isinstance(reloaded.data_dir, Path)
    assert isinstance(reloaded.optim.betas, tuple)


def test_dump_keeps_field_order() -> None:
    keys = list(yaml.safe_load(dump_config(SampleConfig())))

    assert keys[:3] == ["gang", "optim", "max_num_steps"]


def test_config_to_dict_rejects_non_dataclasses() -> None:
    with pytest.raises(TypeError, match="dataclass instance"):
        config_to_dict({"a": 1})


def test_load_config_rejects_non_dataclass_types() -> None:
    with pytest.raises(TypeError, match="Decorate the config class with @dataclass"):
        load_config(dict)


# ----------------------------------------------------------- required keys, meanings


@dataclass
class SourceSection:
    """Where the model comes from."""

    path: Path | None = field(default=None, metadata=exactly_one_of("source"))
    """A model directory.

    Only this first paragraph is the meaning."""
    name: str | None = field(default=None, metadata=exactly_one_of("source"))
    """A model by ``name``:
    one of the built-in ones."""
    revision: int = 0


@dataclass
class BaseRunConfig:
    steps: int = 3
    """Steps to run."""


@dataclass
class RunConfig(BaseRunConfig):
    seed: int = field(kw_only=True)
    """Seeds everything."""
    source: SourceSection = field(default_factory=SourceSection)
    betas: tuple[float, float] = (0.9, 0.95)

    def validate(self) -> None:
        # Runs after the groups are checked, so it may rely on one source being there.
        if self.source.path is not None and self.source.path.name == "bad":
            raise ValueError("source.path must not be 'bad'.")


def test_field_meanings_are_the_first_paragraph_of_each_docstring_on_one_line() -> None:
    assert field_meanings(RunConfig) == {"steps": "Steps to run.", "seed": "Seeds everything."}
    assert field_meanings(SourceSection) == {
        "path": "A model directory.",
        "name": "A model by name: one of the built-in ones.",
    }


def test_config_keys_list_sections_before_their_keys_with_what_they_need() -> None:
    keys = {key.name: key for key in config_keys(RunConfig)}

    assert list(keys) == [
        "steps",
        "seed",
        "source",
        "source.path",
        "source.name",
        "source.revision",
        "betas",
    ]
    assert keys["seed"].requirement == "required"
    assert keys["source.path"].requirement == "required, unless source.name is given"
    assert keys["source.revision"].requirement is None
    # A section without a docstring of its own field takes its class's.
    assert keys["source"].meaning == "Where the model comes from." and keys["source"].is_section


def test_help_gives_each_key_one_meaning_and_marks_the_required_ones() -> None:
    text = config_help(RunConfig, width=100)

    assert "  steps                   Steps to run." in text.splitlines()
    assert "  seed                    [required] Seeds everything." in text.splitlines()
    assert "[required, unless source.path is given] A model by name" in text
    assert "  betas" in text.splitlines()  # no meaning, still listed
    assert all(len(line) <= 100 for line in text.splitlines())


def test_describe_works_before_the_required_keys_and_marks_them() -> None:
    text = describe_config(RunConfig)

    assert text.splitlines() == [
        "steps: 3",
        "seed: null  # required",
        "source:",
        "  path: null  # required, unless source.name is given",
        "  name: null  # required, unless source.path is given",
        "  revision: 0",
        "betas:",
        "- 0.9",
        "- 0.95",
    ]
    assert yaml.safe_load(text)["source"] == {"path": None, "name": None, "revision": 0}


def test_describe_shows_files_and_overrides_and_reloads_to_the_same_config(
    tmp_path: Path,
) -> None:
    file = write_yaml(tmp_path / "a.yaml", {"steps": 7})
    overrides = ["seed=5", "source.name=tiny", "betas=[0.8, 0.9]"]

    text = describe_config(RunConfig, config_files=[file], overrides=overrides)

    loaded = load_config(RunConfig, config_files=[file], overrides=overrides)
    assert (
        load_config(RunConfig, config_files=[write_yaml(tmp_path / "b.yaml", yaml.safe_load(text))])
        == loaded
    )
    assert "  name: tiny  # required, unless source.path is given" in text.splitlines()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["stepz=1"], "Unknown config key 'stepz'"),
        (["seed=1", "steps=x"], "Config key 'steps' expects int, but got 'x'"),
        (["seed=1", "source.path=bad"], "source.path must not be 'bad'."),
    ],
)
def test_describe_still_refuses_what_is_wrong_rather_than_missing(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        describe_config(RunConfig, overrides=overrides)


def test_a_missing_choice_is_one_error_naming_each_key_and_its_meaning() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, overrides=["seed=1"])

    assert str(info.value) == (
        "Give exactly one of source.path or source.name, but neither is set. "
        "source.path: A model directory. source.name: A model by name: one of the built-in ones."
    )
    assert info.value.missing


def test_a_choice_given_twice_is_an_error_not_a_missing_key() -> None:
    with pytest.raises(ConfigError, match="but both are set") as info:
        load_config(RunConfig, overrides=["seed=1", "source.path=/m", "source.name=tiny"])

    assert not info.value.missing
    assert load_config(RunConfig, overrides=["seed=1", "source.name=tiny"]).source.name == "tiny"

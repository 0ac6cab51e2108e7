"""Settings: a TOML file gives defaults, the environment wins, mistakes are named."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tuner.core.settings import KNOWN, read_config, refusal


def test_file_fills_what_the_environment_leaves_unset(tmp_path):
    """The file is read when the process dispatcher is made."""
    cfg = tmp_path / "config.toml"
    cfg.write_text('mode = "record"\ncache = "/from/file.db"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNER_")}
    env |= {"TUNER_CONFIG": str(cfg), "TUNER_CACHE": "/from/env.db"}
    code = (
        "import os; from tuner.serving.dispatcher import get_dispatcher; get_dispatcher(); "
        "print(os.environ['TUNER_MODE'], os.environ['TUNER_CACHE'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["record", "/from/env.db"]


def test_relative_paths_in_the_file_are_taken_from_its_folder(tmp_path, monkeypatch):
    """``cache = "tuner.db"`` beside the config file means that file, wherever a command runs;
    ``~`` is the home folder, and a path given whole stays as it is."""
    cfg = tmp_path / "etc" / "config.toml"
    cfg.parent.mkdir()
    cfg.write_text('cache = "tuner.db"\nartifacts = "../kernels"\nserver_db = "~/fleet.db"\n'
                   'profile = "/var/prof"\nserver = "http://h:1"\n')  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/u")
    values, problems = read_config(Path("etc/config.toml"))
    assert not problems and values == {
        "TUNER_CACHE": str(cfg.parent / "tuner.db"),
        "TUNER_ARTIFACTS": str(cfg.parent / "../kernels"),
        "TUNER_SERVER_DB": "/home/u/fleet.db",
        "TUNER_PROFILE": "/var/prof",
        "TUNER_SERVER": "http://h:1",
    }


def test_a_linked_file_takes_paths_from_the_links_folder_and_a_bom_is_read(tmp_path):
    """A config file linked from a dotfiles folder names paths beside the link, where ``tuner
    info`` says the config is; a file an editor saved with a byte-order mark is still TOML."""
    dotfiles, home = tmp_path / "dotfiles", tmp_path / "config"
    dotfiles.mkdir()
    home.mkdir()
    (dotfiles / "tuner.toml").write_bytes('\ufeffcache = "tuner.db"\n'.encode())
    (home / "config.toml").symlink_to(dotfiles / "tuner.toml")
    values, problems = read_config(home / "config.toml")
    assert not problems and values == {"TUNER_CACHE": str(home / "tuner.db")}


@pytest.mark.parametrize(
    "start",
    ["from tuner.serving.dispatcher import get_dispatcher; get_dispatcher()",
     "import tuner.cli.main; tuner.cli.main.load_config_file()"],
)  # fmt: skip
def test_the_files_fast_launch_setting_applies(tmp_path, start):
    """``triton_fast_launch = false`` in the file applies: the flag is read after the process
    dispatcher (or the CLI's start) loads the file, not when its module is imported."""
    cfg = tmp_path / "config.toml"
    cfg.write_text("triton_fast_launch = false\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TUNER_", "TRITON_"))}
    env |= {"TUNER_CONFIG": str(cfg), "TUNER_CACHE": str(tmp_path / "c.db")}
    code = (
        f"from types import SimpleNamespace; {start}; "
        "from tuner.core.triton_launch import Launcher; "
        "print(Launcher(SimpleNamespace(params=[]), (1,), {}, num_warps=4, num_stages=1)._fast)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False"]


def test_an_empty_variable_is_an_unset_one(tmp_path):
    """``TUNER_CACHE=`` (a variable emptied in a script) leaves the file's value in force, and
    an empty mode or stale policy is the default, not an error."""
    cfg = tmp_path / "config.toml"
    cfg.write_text('cache = "/from/file.db"\nbuckets = "none"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNER_")}
    env |= {"TUNER_CONFIG": str(cfg), "TUNER_CACHE": "", "TUNER_MODE": "", "TUNER_STALE": ""}
    code = (
        "import os; from tuner.serving.dispatcher import get_dispatcher; d = get_dispatcher(); "
        "print(d.mode, d.stale, d.store_path)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["lookup", "use", "/from/file.db"]
    # so tuner info does not mark them as refused
    assert [refusal(name, "") for name in ("mode", "stale", "triton_fast_launch")] == [None] * 3


def test_a_mistake_is_named_and_left_out_while_the_rest_applies(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('mdoe = "record"\ncache = "/data/t.db"\nartifacts = "/data/k"\nbuckets = [1]\n')
    values, problems = read_config(cfg)
    assert values == {"TUNER_CACHE": "/data/t.db", "TUNER_ARTIFACTS": "/data/k"}
    assert "unknown setting 'mdoe' (did you mean 'mode'?) left out" in problems[0]
    assert "buckets must be a string or number, got [1]" in problems[1]


def test_a_word_a_setting_does_not_take_is_named_and_left_out(tmp_path):
    """The dispatcher then starts on the default instead of failing at its first call."""
    cfg = tmp_path / "config.toml"
    cfg.write_text('mode = "recrd"\nstale = "ignore"\nbuckets = "pow3"\n')
    values, problems = read_config(cfg)
    assert values == {"TUNER_STALE": "ignore"}
    assert problems == [
        f"{cfg}: mode must be one of ['off', 'lookup', 'record', 'tune'], got 'recrd'; left out",
        f"{cfg}: buckets must be one of ['exact', 'next_tuned_above', 'pow2'], got 'pow3'; left out",
    ]


def test_every_tuner_variable_the_code_reads_can_go_in_the_file():
    read = set()
    root = Path(__file__).parents[2]
    for path in [*(root / "tuner").rglob("*.py"), *(root / "server").rglob("*.py")]:
        read |= set(re.findall(r"TUNER_([A-Z_]+)", path.read_text()))
    internal = {"CONFIG", "PARENT_PID"}  # where the file is; set by tune-all for its workers
    assert {name.lower() for name in read - internal} <= set(KNOWN)


def test_a_config_path_that_names_no_file_is_reported(tmp_path):
    env = os.environ | {"TUNER_CONFIG": str(tmp_path / "typo.toml")}
    out = subprocess.run(
        [sys.executable, "-c", "import tuner; tuner.set_mode('off')"], env=env,
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0 and "typo.toml: no such file" in out.stderr


def test_broken_file_is_reported_not_fatal(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text("mode = \n")
    env = os.environ | {"TUNER_CONFIG": str(cfg)}
    out = subprocess.run(
        [sys.executable, "-c", "import tuner; tuner.set_mode('off')"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "not valid TOML" in out.stderr


def test_a_broken_file_stops_a_command_but_not_info_or_help(tmp_path):
    """A command run without its config file would write to another cache or ask another
    service: it is refused in one line naming the file, the fault and a hint, and writes
    nothing; ``tuner info`` (which shows the settings in use), ``--help`` and a group's help
    (``tuner tune`` given nothing) still run."""
    cfg, cache = tmp_path / "config.toml", tmp_path / "from-file.db"
    cfg.write_text(f'cache = "{cache}"\nmode = record\n')
    env = os.environ | {"TUNER_CONFIG": str(cfg), "TUNER_CACHE": "", "COLUMNS": "200"}

    def tuner(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tuner", *args], env=env,
                              capture_output=True, text=True)  # fmt: skip

    r = tuner("tune", "gemm", "-m", "4", "-n", "8", "-k", "8", "--source", "torch")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {cfg}: not valid TOML: Invalid value (at line 2")
    assert "(strings take quotes: mode = 'record')" in r.stderr
    assert not cache.exists()
    assert tuner("info").returncode == 0
    assert tuner("show", "--help").returncode == 0
    for group in ("tune", "token", "tunableop"):  # given nothing: its help, as with a good file
        r = tuner(group)
        assert "Usage:" in r.stdout and "─ Commands ─" in r.stdout, r.stderr
        assert "error:" not in r.stderr


def test_a_numeric_variable_that_is_no_positive_number_is_named_and_its_default_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tuner.candidates.nvcc_build import default_jobs
    from tuner.core.settings import env_number

    for text, want in (("3", 3), ("", 16), ("abc", 16), ("0", 16), ("-2", 16)):
        monkeypatch.setenv("TUNER_COMPILE_WORKERS", text)
        assert env_number("TUNER_COMPILE_WORKERS", 16) == want
    assert (
        "TUNER_COMPILE_WORKERS (environment variable) must be a whole number from 1 to 1024, "
        "got '-2'; using 16 (the default)" in caplog.text
    )
    monkeypatch.setenv("TUNER_CUTLASS_COMPILE_TIMEOUT", "1.5")
    assert env_number("TUNER_CUTLASS_COMPILE_TIMEOUT", 900.0) == 1.5
    monkeypatch.setenv("TUNER_CUTLASS_JOBS", "many")
    assert default_jobs(2) == min(2, os.cpu_count() or 1)


def test_an_on_off_variable_takes_the_usual_words_and_names_any_other(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``0``, ``false``, ``off`` and ``no`` (any case) turn a flag off, the usual words for on
    turn it on, empty leaves the default, and any other word is logged and the default used."""
    from tuner.core.settings import env_flag

    name = "TUNER_TRITON_FAST_LAUNCH"
    for text in ("0", "false", "FALSE", "no", "Off", " off "):
        monkeypatch.setenv(name, text)
        assert env_flag(name, True) is False, text
    for text in ("1", "true", "Yes", "ON"):
        monkeypatch.setenv(name, text)
        assert env_flag(name, False) is True, text
    monkeypatch.setenv(name, "")
    assert env_flag(name, True) is True  # empty is unset, as for every TUNER_* variable
    assert not caplog.text
    monkeypatch.setenv(name, "nope")
    assert env_flag(name, True) is True
    assert (
        "TUNER_TRITON_FAST_LAUNCH='nope': expected one of 1/0, true/false, yes/no, on/off; "
        "using on (the default)" in caplog.text
    )


def test_an_on_off_setting_in_the_file_takes_the_same_words(tmp_path):
    cfg = tmp_path / "config.toml"
    for text, want in (('"off"', "off"), ("false", "0"), ("true", "1"), ('"Yes"', "Yes")):
        cfg.write_text(f"triton_fast_launch = {text}\n")
        assert read_config(cfg) == ({"TUNER_TRITON_FAST_LAUNCH": want}, [])
    cfg.write_text('triton_fast_launch = "nope"\n')
    assert read_config(cfg) == ({}, [
        f"{cfg}: triton_fast_launch must be one of 1/0, true/false, yes/no, on/off, "
        "got 'nope'; left out"
    ])  # fmt: skip


def test_a_value_of_the_wrong_type_for_its_setting_is_named_and_left_out(tmp_path):
    """TOML's ``false`` for a folder would be the folder ``0``, ``true`` a 1 s sync interval,
    ``cache = 5`` a cache file named 5: each is named and left out, the rest applies."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        'profile = false\nsync_interval = true\nserver_timeout = "abc"\ncache = 5\n'
        'compile_workers = 0\nartifacts_max_bytes = 1e9\ncutlass_jobs = "2"\n'
        'cublas_algos = 3\nserver_db = "/data/fleet.db"\n'
    )
    values, problems = read_config(cfg)
    assert values == {
        "TUNER_ARTIFACTS_MAX_BYTES": "1000000000",  # a whole float: TOML's 1e9
        "TUNER_CUTLASS_JOBS": "2",
        "TUNER_CUBLAS_ALGOS": "3",  # one algorithm id
        "TUNER_SERVER_DB": "/data/fleet.db",
    }
    assert problems == [
        f"{cfg}: profile must be a string, got False; left out",
        f"{cfg}: sync_interval (config file) must be a number from 1 to 604800, got True; left out",
        f"{cfg}: server_timeout (config file) must be a finite number of at least 0.1, got 'abc'; "
        "left out",
        f"{cfg}: cache must be a string (in quotes), got 5; left out",
        f"{cfg}: compile_workers (config file) must be a whole number from 1 to 1024, got 0; "
        "left out",
    ]


def test_a_number_variable_out_of_its_bounds_is_marked_for_info():
    """The bounds are those of the code that reads each: a sync interval under 1 s falls back
    to the default, a timeout under 0.1 s is refused by tuner sync."""
    assert refusal("compile_workers", "many") == (
        "not a whole number from 1 to 1024: the default is used, and logged"
    )
    assert refusal("sync_interval", "0.5") == (
        "not a number from 1 to 604800: the default is used, and logged"
    )
    assert refusal("sync_interval", "2") is None and refusal("cutlass_jobs", "") is None
    assert refusal("server_timeout", "0.01") == (
        "not a finite number of at least 0.1: tuner sync, push and artifacts refuse it; the background "
        "sync, warmup and tune-all use the default, and log it"
    )


def test_a_token_of_digits_in_the_file_is_a_token(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text("token = 123456\n")
    assert read_config(cfg) == ({"TUNER_TOKEN": "123456"}, [])


def test_a_variable_name_in_the_file_is_taken_for_its_setting_name_in_the_guess(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('TUNER_CACHE = "/data/t.db"\nzzz = 1\n')
    _, problems = read_config(cfg)
    assert "unknown setting 'TUNER_CACHE' (did you mean 'cache'?) left out" in problems[0]
    assert "unknown setting 'zzz' left out" in problems[1]


def test_settings_under_a_table_are_named_as_such(tmp_path):
    """A file written as `[tuner]` then its settings got only "unknown setting 'tuner'": the
    answer says settings sit at the top of the file, and names those left out."""
    cfg = tmp_path / "config.toml"
    cfg.write_text('mode = "tune"\n[tuner]\ncache = "/data/t.db"\nbuckets = "pow2"\n')
    values, problems = read_config(cfg)
    assert values == {"TUNER_MODE": "tune"}
    (problem,) = problems
    assert "[tuner] is a table" in problem and "['buckets', 'cache'] left out" in problem


INTEGRAL = ("1e9", "1000000000", "1E9", "1000000000.0")
NOT_WHOLE = ("1.5", "0", "-3", "abc", "nan", "inf")


@pytest.mark.parametrize("text", INTEGRAL)
def test_a_size_limit_is_taken_from_the_environment_as_from_the_file(
    text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TUNER_ARTIFACTS_MAX_BYTES=1e9`` and ``artifacts_max_bytes = 1e9`` in the file both take
    any whole number, however written."""
    from tuner.cache.artifacts import default_max_bytes

    monkeypatch.setenv("TUNER_ARTIFACTS_MAX_BYTES", text)
    assert default_max_bytes() == 1_000_000_000
    cfg = tmp_path / "config.toml"
    cfg.write_text(f"artifacts_max_bytes = {text.lower()}\n")  # TOML's floats: 1e9, 1e9 as 1E9
    assert read_config(cfg) == ({"TUNER_ARTIFACTS_MAX_BYTES": "1000000000"}, [])


@pytest.mark.parametrize("text", NOT_WHOLE)
def test_a_size_limit_that_is_no_positive_whole_number_is_refused_from_either_source(
    text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rule, one message: the setting, where the value came from, the value."""
    from tuner.cache.artifacts import default_max_bytes

    rule = "must be a positive whole number of bytes (as 1000000000 or 1e9)"
    monkeypatch.setenv("TUNER_ARTIFACTS_MAX_BYTES", text)
    with pytest.raises(ValueError) as refused:
        default_max_bytes()
    assert str(refused.value) == (
        f"TUNER_ARTIFACTS_MAX_BYTES (environment variable) {rule}, got {text!r}"
    )
    cfg = tmp_path / "config.toml"
    toml = text if text != "abc" else '"abc"'  # nan and inf are TOML floats
    cfg.write_text(f"artifacts_max_bytes = {toml}\n")
    values, problems = read_config(cfg)
    file_value = tomllib.loads(f"v = {toml}")["v"]
    assert values == {}
    assert problems == [
        f"{cfg}: artifacts_max_bytes (config file) {rule}, got {file_value!r}; left out"
    ]


@pytest.mark.parametrize("name", ["compile_workers", "cutlass_jobs"])
def test_every_whole_number_setting_reads_its_environment_as_its_file(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The other whole-number settings read ``1e1`` alike from the environment and the file;
    a number that is not whole is logged and the default used."""
    from tuner.core.settings import env_number

    variable = f"TUNER_{name.upper()}"
    monkeypatch.setenv(variable, "1e1")
    assert env_number(variable, 16) == 10
    cfg = tmp_path / "config.toml"
    cfg.write_text(f"{name} = 1e1\n")
    assert read_config(cfg) == ({variable: "10"}, [])
    monkeypatch.setenv(variable, "2.5")
    assert env_number(variable, 16) == 16
    assert f"{variable} (environment variable) must be a whole number from 1 to 1024" in (
        caplog.text
    )
    assert "got '2.5'; using 16 (the default)" in caplog.text


@pytest.mark.parametrize("text", ["1e30", "3000000000", "1025"])
def test_a_worker_count_past_its_bound_is_logged_and_the_default_used_not_a_crash(
    text: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``TUNER_COMPILE_WORKERS=1e30`` is a whole number, but past what the Triton compile pool
    can be made with (OverflowError: a semaphore of C int). Worker counts are bounded: past the
    bound the value is logged and the default used, and ``tuner info`` says so."""
    from tuner.candidates import nvcc_build
    from tuner.candidates.triton_kernels import launch

    default = min(16, os.cpu_count() or 1)
    monkeypatch.setenv("TUNER_COMPILE_WORKERS", text)
    monkeypatch.setattr(launch, "_pool", None)
    pool = launch._get_pool()
    try:
        assert pool._max_workers == default
    finally:
        pool.shutdown()
    monkeypatch.setenv("TUNER_CUTLASS_JOBS", text)
    assert nvcc_build.default_jobs(1) == 1
    rule = "must be a whole number from 1 to 1024, got"
    assert f"TUNER_COMPILE_WORKERS (environment variable) {rule} '{text}'" in caplog.text
    assert f"TUNER_CUTLASS_JOBS (environment variable) {rule} '{text}'" in caplog.text
    for name in ("compile_workers", "cutlass_jobs"):
        assert refusal(name, text) == (
            "not a whole number from 1 to 1024: the default is used, and logged"
        )
        assert refusal(name, "1024") is None and refusal(name, "1e3") is None

"""The config loader: presets, defaults, overrides, and a table of rejected inputs."""
from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from phalanx.configs.errors import ConfigError
from phalanx.configs.introspect import walk_leaves
from phalanx.configs.loader import dump_config, load_config
from phalanx.configs.reference import render_reference
from phalanx.configs.schema import JobConfig, PhalanxConfig

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ENTRY = "examples/train_mlp.py:main"
# Lines 1-2 of every bad input below; the table's line numbers count from here.
BASE = f"job:\n  entrypoint: {ENTRY}\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "file.yaml"
    path.write_text(text)
    return path


def minimal(**job: object) -> PhalanxConfig:
    return PhalanxConfig(job=JobConfig(entrypoint=ENTRY, **job))  # type: ignore[arg-type]


# --- presets and defaults -----------------------------------------------------------------


def test_demo_preset_loads() -> None:
    cfg = load_config(CONFIGS / "demo.yaml", env={})
    assert (cfg.job.name, cfg.job.entrypoint) == ("demo", ENTRY)
    assert (cfg.job.world_size, cfg.job.nodes, cfg.ray.virtual_nodes) == (4, 2, 2)
    assert cfg.job.args == {"steps": 60, "batch_size": 32, "hidden": 64, "lr": 0.05, "seed": 0,
                            "sleep_per_step_s": 0.05}
    assert (cfg.spares.count, cfg.replication.factor) == (1, 1)
    assert (cfg.tiers.disk.enabled, cfg.tiers.disk.every_steps) == (True, 20)
    assert cfg.detection.stall_timeout_s == 5.0
    assert isinstance(cfg.detection.stall_timeout_s, float)


def test_spares_preset_loads() -> None:
    cfg = load_config(CONFIGS / "spares.yaml", env={})
    assert cfg.spares.count == 2
    assert cfg.spares.on_exhausted == "restart"


def test_kill_worker_drill_is_well_formed_yaml() -> None:
    scenario = yaml.safe_load((CONFIGS / "drills" / "kill_worker.yaml").read_text())
    assert scenario["name"] == "kill_worker"
    assert scenario["faults"] == [{"kind": "kill_worker", "target": {"rank": 1},
                                   "trigger": {"at_step": 20}}]
    assert scenario["expect"] == {"max_recovery_s": 5, "max_lost_steps": 1,
                                  "final_state": "identical"}


def test_defaults_need_only_an_entrypoint(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, BASE), env={}) == minimal()
    assert load_config(None, [f"job.entrypoint={ENTRY}"], env={}) == minimal()


def test_empty_file_means_defaults_and_names_the_missing_entrypoint(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), [f"job.entrypoint={ENTRY}"], env={}) == minimal()
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "# only a comment\n"), env={})
    assert info.value.key == "job.entrypoint" and "is required" in str(info.value)


def test_empty_section_means_its_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, BASE + "spares:\ntiers:\n  s3:\n"), env={})
    assert cfg == minimal()


def test_ints_are_accepted_for_floats(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, BASE + "  timeout_s: 60\n  cpus_per_worker: 1e-1\n"),
                      env={})
    assert cfg.job.timeout_s == 60.0 and isinstance(cfg.job.timeout_s, float)
    assert cfg.job.cpus_per_worker == 0.1


def test_tier_every_s_defaults_off_and_loads_as_seconds(tmp_path: Path) -> None:
    assert (minimal().tiers.disk.every_s, minimal().tiers.s3.every_s) == (0.0, 0.0)
    cfg = load_config(write(tmp_path, BASE + "tiers:\n  disk:\n    every_s: 600\n"),
                      ["tiers.s3.every_s=30.5"], env={})
    assert cfg.tiers.disk.every_s == 600.0 and isinstance(cfg.tiers.disk.every_s, float)
    assert cfg.tiers.s3.every_s == 30.5


def test_relative_paths_stay_as_written(tmp_path: Path) -> None:
    text = BASE.replace(ENTRY, "rel/train.py:main") + (
        "  run_dir: runs\ntiers:\n  disk:\n    path: ckpt\ndrills:\n  scenario: d.yaml\n"
        "security:\n  secret_file: s.key\netcd:\n  endpoints: ['h:1']\n  user: u\n"
        "  password_file: pw\n"
        "  tls: {ca_file: ca.pem, cert_file: c.pem, key_file: k.pem}\n")
    cfg = load_config(write(tmp_path, text), env={})
    assert (cfg.job.entrypoint, cfg.job.run_dir, cfg.tiers.disk.path) == (
        "rel/train.py:main", "runs", "ckpt")
    assert (cfg.drills.scenario, cfg.security.secret_file, cfg.etcd.password_file) == (
        "d.yaml", "s.key", "pw")
    assert dataclasses.astuple(cfg.etcd.tls) == ("ca.pem", "c.pem", "k.pem")


# --- overrides ----------------------------------------------------------------------------


def test_set_overrides_scalars_lists_auto_and_args() -> None:
    cfg = load_config(CONFIGS / "demo.yaml", [
        "job.world_size=2", "etcd.endpoints=[a:1,b:2]", "snapshot.every_steps=auto",
        "job.args.steps=10", "tiers.s3={enabled: true, bucket: my-bucket}"], env={})
    assert cfg.job.world_size == 2
    assert cfg.etcd.endpoints == ["a:1", "b:2"]
    assert cfg.snapshot.every_steps == "auto"
    assert cfg.job.args["steps"] == 10 and cfg.job.args["hidden"] == 64
    assert (cfg.tiers.s3.enabled, cfg.tiers.s3.bucket) == (True, "my-bucket")


def test_set_creates_sections_missing_from_the_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, BASE), ["tiers.disk.keep=5", "job.name=x"], env={})
    assert (cfg.tiers.disk.keep, cfg.job.name) == (5, "x")


def test_phalanx_set_env_applies_and_set_wins() -> None:
    env = {"PHALANX_SET": "spares.count=0; job.name=from-env;;ray.cpus_per_node=4"}
    cfg = load_config(CONFIGS / "demo.yaml", ["job.name=from-cli"], env=env)
    assert (cfg.spares.count, cfg.ray.cpus_per_node, cfg.job.name) == (0, 4.0, "from-cli")


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_SET", "spares.count=0")
    assert load_config(CONFIGS / "demo.yaml").spares.count == 0


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config(CONFIGS / "demo.yaml", ["snapshot.every_steps=auto",
                                              "tiers.s3.expected_owner='0123'"], env={})
    path = tmp_path / "effective.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path, env={}) == cfg


def test_config_error_pickles() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "demo.yaml", ["job.world_size=0"], env={})
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == str(info.value)


# --- rejected inputs ----------------------------------------------------------------------

# (id, file text, --set, PHALANX_SET, key, source ("file" = the YAML file), line, fragment)
BAD = [
    ("unknown-top-level", BASE + "colour: red\n", [], "",
     "colour", "file", 3, "unknown key"),
    ("unknown-nested-did-you-mean", BASE + "etcd:\n  lease_tll_s: 3\n", [], "",
     "etcd.lease_tll_s", "file", 4, "did you mean 'lease_ttl_s'"),
    ("int-given-str", BASE + "  world_size: four\n", [], "",
     "job.world_size", "file", 3, "got 'four' (str), expected int"),
    ("bool-given-1", BASE + "snapshot:\n  enabled: 1\n", [], "",
     "snapshot.enabled", "file", 4, "got 1 (int), expected bool"),
    ("bool-given-string", BASE + "snapshot:\n  enabled: 'true'\n", [], "",
     "snapshot.enabled", "file", 4, "got 'true' (str), expected bool"),
    ("float-given-fast", BASE + "detection:\n  stall_timeout_s: fast\n", [], "",
     "detection.stall_timeout_s", "file", 4, "got 'fast' (str), expected float"),
    ("float-given-inf", BASE + "  timeout_s: .inf\n", [], "",
     "job.timeout_s", "file", 3, "got inf (float), expected float"),
    ("empty-value", BASE + "  timeout_s:\n", [], "",
     "job.timeout_s", "file", 3, "got nothing (null), expected float"),
    ("list-given-scalar", BASE + "etcd:\n  endpoints: localhost:2379\n", [], "",
     "etcd.endpoints", "file", 4, "expected list[str]"),
    ("str-given-int", BASE + "  name: 2024\n", [], "",
     "job.name", "file", 3, "got 2024 (int), expected str"),
    ("section-given-scalar", BASE + "ray: 4\n", [], "",
     "ray", "file", 3, "is 4 (int), expected a mapping"),
    ("top-level-not-mapping", "- job\n- etcd\n", [], "",
     "(root)", "file", 1, "is a list, expected a mapping"),
    ("duplicate-key", BASE + "  nodes: 1\n  nodes: 2\n", [], "",
     "job.nodes", "file", 4, "appears twice in one mapping (first on line 3)"),
    ("heartbeat-not-below-ttl", BASE + "etcd:\n  lease_ttl_s: 2\n  heartbeat_s: 2\n", [], "",
     "etcd.heartbeat_s", "file", 5, "below lease_ttl_s"),
    ("lease-ttl-below-1", BASE + "etcd:\n  lease_ttl_s: 0.5\n", [], "",
     "etcd.lease_ttl_s", "file", 4, "below 1 s"),
    ("world-size-0", BASE + "  world_size: 0\n", [], "",
     "job.world_size", "file", 3, "0 is below 1"),
    ("entrypoint-without-colon", "job:\n  entrypoint: train\n", [], "",
     "job.entrypoint", "file", 2, "is neither a script nor a function"),
    ("nodes-above-virtual-nodes", BASE + "  world_size: 4\n  nodes: 3\nray:\n  virtual_nodes: 2\n",
     [], "", "job.nodes", "file", 4, "ray.virtual_nodes is 2"),
    ("cpu-budget", BASE + "  world_size: 8\n  cpus_per_worker: 1\n", [], "",
     "job.world_size", "file", 3, "9.0 CPUs, the Ray cluster offers 4.0"),
    ("replication-factor-needs-nodes", BASE + "replication:\n  factor: 2\n", [], "",
     "replication.factor", "file", 4, "2 replicas need 3 nodes"),
    ("s3-without-bucket", BASE + "tiers:\n  s3:\n    enabled: true\n", [], "",
     "tiers.s3.bucket", "file", 4, "is required when tiers.s3.enabled"),
    ("s3-bad-sse", BASE + "tiers:\n  s3:\n    enabled: true\n    bucket: b\n    sse: rot13\n",
     [], "", "tiers.s3.sse", "file", 7, "'rot13' is unknown"),
    ("disk-every-s-negative", BASE + "tiers:\n  disk:\n    every_s: -5\n", [], "",
     "tiers.disk.every_s", "file", 5, "-5.0 is not a number of seconds >= 0"),
    ("s3-every-s-negative", BASE, ["tiers.s3.every_s=-1"], "",
     "tiers.s3.every_s", "--set", None, "is not a number of seconds >= 0"),
    ("disk-every-steps-zero", BASE + "tiers:\n  disk:\n    every_steps: 0\n", [], "",
     "tiers.disk.every_steps", "file", 5, "0 is neither 'auto' nor >= 1"),
    ("disk-every-steps-often", BASE, ["tiers.disk.every_steps=often"], "",
     "tiers.disk.every_steps", "--set", None, "expected int or 'auto'"),
    ("every-steps-sometimes", BASE + "snapshot:\n  every_steps: sometimes\n", [], "",
     "snapshot.every_steps", "file", 4, "got 'sometimes' (str), expected int or 'auto'"),
    ("overhead-budget-1.5", BASE + "snapshot:\n  overhead_budget: 1.5\n", [], "",
     "snapshot.overhead_budget", "file", 4, "outside (0, 1)"),
    ("slots-1", BASE + "snapshot:\n  slots: 1\n", [], "",
     "snapshot.slots", "file", 4, "1 is below 2"),
    ("on-exhausted-pray", BASE + "spares:\n  on_exhausted: pray\n", [], "",
     "spares.on_exhausted", "file", 4, "expected 'restart' or 'wait' or 'fail'"),
    ("job-name-slash", BASE + "  name: a/b\n", [], "",
     "job.name", "file", 3, "'a/b' has characters"),
    ("args-not-json", BASE + "  args: {when: 2024-01-01}\n", [], "",
     "job.args.when", "file", 3, "expected a JSON value"),
    ("yaml-syntax-flow", BASE + "  name: [unclosed\n  nodes: 2\n", [], "",
     "(yaml)", "file", 4, "while parsing a flow sequence on line 3"),
    ("yaml-syntax-indent", BASE + " name: a\n", [], "",
     "(yaml)", "file", 3, "invalid YAML"),
    ("set-without-equals", BASE, ["job.world_size"], "",
     "job.world_size", "--set", None, "has no '='"),
    ("set-unknown-path", BASE, ["job.wrld_size=4"], "",
     "job.wrld_size", "--set", None, "did you mean 'world_size'"),
    ("set-below-a-leaf", BASE, ["job.world_size.x=4"], "",
     "job.world_size", "--set", None, "not a section"),
    ("set-wrong-type", BASE, ["spares.count=many"], "",
     "spares.count", "--set", None, "got 'many' (str), expected int"),
    ("set-bad-yaml", BASE, ["etcd.endpoints=[a:1"], "",
     "etcd.endpoints", "--set", None, "is not valid YAML"),
    ("env-unknown-path", BASE, [], "spares.cout=1",
     "spares.cout", "PHALANX_SET", None, "did you mean 'count'"),
    ("env-cross-field", BASE, [], "etcd.heartbeat_s=5",
     "etcd.heartbeat_s", "PHALANX_SET", None, "below lease_ttl_s"),
]


@pytest.mark.parametrize(("text", "overrides", "env_set", "key", "source", "line", "fragment"),
                         [pytest.param(*case[1:], id=case[0]) for case in BAD])
def test_bad_input_is_a_located_config_error(
        tmp_path: Path, text: str, overrides: list[str], env_set: str, key: str,
        source: str, line: int | None, fragment: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, env={"PHALANX_SET": env_set})
    error = info.value
    assert type(error) is ConfigError
    expected_source = str(path) if source == "file" else source
    assert (error.key, error.source, error.line) == (key, expected_source, line)
    where = f"file.yaml:{line}: {key}" if line is not None else f"{source}: {key}"
    assert where in str(error)
    assert fragment in str(error)
    assert error.hint, "every config error says what to do"


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", env={})


def test_cross_field_error_falls_back_to_the_section_line(tmp_path: Path) -> None:
    # The CPU budget check names job.world_size, which this file does not set: the error
    # points at the `job:` section instead.
    text = BASE + "  cpus_per_worker: 2\n"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env={})
    assert (info.value.key, info.value.line) == ("job.world_size", 1)


# --- reference ----------------------------------------------------------------------------


def test_reference_lists_every_leaf_field() -> None:
    text = render_reference()
    leaves = list(walk_leaves(PhalanxConfig))
    assert len(leaves) > 50
    for leaf in leaves:
        assert f"| `{leaf.path}` |" in text, leaf.path
    assert "| `snapshot.every_steps` | int or 'auto' | `auto` |" in text


def test_reference_module_prints_the_reference() -> None:
    result = subprocess.run([sys.executable, "-m", "phalanx.configs.reference"], capture_output=True,
                            text=True, timeout=20, check=True)
    assert result.stdout == render_reference()

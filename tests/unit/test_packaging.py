"""The package as users install it: a wheel that carries every data file, one `trimlab`
import namespace, an `[agent]` install without the controller's dependencies, and the
layers contract. Fresh environments get the project only from the wheel (the source tree
is not importable there) and third-party packages from this environment, with no network."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from trimlab.testbed import provision

ROOT = Path(__file__).resolve().parents[2]
CONTROLLER_ONLY = ("ansible", "ansible_runner", "paramiko", "pandas", "pyarrow", "plotly")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return provision.build_agent_wheel(tmp_path_factory.mktemp("wheel"))  # the hosts' wheel is the users'



def _closure(extra: str) -> set[str]:
    """This environment's distributions that trimlab[extra] needs, transitively."""
    todo = [(canonicalize_name("trimlab"), {extra})]
    seen: dict[str, set[str]] = {}
    while todo:
        name, extras = todo.pop()
        if name in seen and extras <= seen[name]:
            continue
        seen[name] = seen.get(name, set()) | extras
        for line in md.distribution(name).requires or []:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in seen[name] | {""}):
                continue
            todo.append((canonicalize_name(req.name), set(req.extras)))
    seen.pop(canonicalize_name("trimlab"))
    return set(seen)


def _environment(tmp: Path, extra: str, wheel: Path) -> Path:
    """A new venv holding the wheel, and (through a .pth) only the distributions of
    trimlab[extra] from this one. Returns its python."""
    env = tmp / f"env-{extra}"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
    python = env / "bin" / "python"
    deps = tmp / f"deps-{extra}"
    deps.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for name in _closure(extra):
        dist = md.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            src = Path(dist.locate_file(top))
            if src.exists() and not (deps / top).exists() and src.parent == site:
                (deps / top).symlink_to(src)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "trimlab-test-deps.pth").write_text(f"{deps}\n")
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return python


def _clean_env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return env | {"TRIMLAB_CACHE": str(tmp / "cache"), "PYTHONNOUSERSITE": "1"}


def test_the_wheel_carries_every_data_file_under_one_namespace(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names if not n.startswith("trimlab-")}
    assert tops == {"trimlab"}, tops  # no top-level core, testbed, agents, analysis or bench
    for f in ["trimlab/switch_configs/profiles/default.yml", "trimlab/switch_configs/sonic/config_db.json.j2",
              "trimlab/switch_configs/cumulus/nvue.sh.j2", "trimlab/switch_configs/vswitch/inject.json.j2",
              "trimlab/playbooks/site.yml", "trimlab/playbooks/roles/trim_switch/tasks/sonic.yml",
              "trimlab/playbooks/inventories/lab.example.yml", "trimlab/experiments/default.yaml",
              "trimlab/examples/ddp_train.py", "trimlab/testbed/vrack/vswitch/trim.c", "trimlab/analysis/walk.c",
              "trimlab/bench/blast.c", "trimlab/agents/rx.c", "trimlab/agents/ddp_hook.py", "trimlab/codec/embedded.py",
              "trimlab/codec/kernels.c", "trimlab/switch_configs/platforms.yml", "trimlab/agents/bpf_csum.h"]:
        assert f in names, f


def test_an_installed_wheel_works_outside_the_source_tree(wheel, tmp_path):
    python = _environment(tmp_path, "controller", wheel)
    cli = python.parent / "trimlab"
    env = _clean_env(tmp_path)

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)

    where = run(python, "-c", "import trimlab; print(trimlab.__file__)")
    assert where.returncode == 0 and where.stdout.startswith(str(tmp_path)), where
    plan = run(cli, "plan", "--trim-size", "128", "--mtu", "1500", "--json")
    assert plan.returncode == 0 and '"bits_per_coord_kept"' in plan.stdout, plan.stderr
    sonic = run(cli, "switch", "render", "default", "--target", "sonic")
    assert sonic.returncode == 0 and "SWITCH_TRIMMING" in sonic.stdout, sonic.stderr
    cumulus = run(cli, "switch", "render", "cumulus-default", "--target", "cumulus")
    assert cumulus.returncode == 0 and "nv set system forwarding packet-trim" in cumulus.stdout, cumulus.stderr
    limit = run(cli, "switch", "render", "default", "--target", "cumulus")  # found, and checked
    assert limit.returncode == 2 and "platform cumulus-spectrum allows 256..1024" in limit.stderr, limit.stderr
    assert run(cli, "run", "--help").returncode == 0
    modules = run(python, "-c", "import trimlab.testbed.orchestrator, trimlab.bench.ddp, trimlab.analysis.report")
    assert modules.returncode == 0, modules.stderr
    spec = run(python, "-c", "from trimlab.spec import load_experiment; s = load_experiment('experiments/default.yaml');"
                             "print(s.name, len(s.points()))")
    assert spec.returncode == 0 and spec.stdout.split()[0] == "default", spec.stderr
    walk = run(python, "-c", "from trimlab.analysis import pcap; print(pcap._walker() is not None)")
    assert walk.stdout.strip() == "True", walk.stderr  # walk.c shipped and compiled from the wheel
    playbook = run(python, "-c", "from trimlab.testbed import provision; print(provision.PLAYBOOK_DIR / 'site.yml')")
    assert Path(playbook.stdout.strip()).is_file() and playbook.stdout.startswith(str(tmp_path)), playbook


def test_the_agent_extra_runs_agents_and_hook_without_the_controller(wheel, tmp_path):
    python = _environment(tmp_path, "agent", wheel)
    code = ("import importlib.util, trimlab.agents.worker, trimlab.agents.ps, trimlab.agents.traffic, "
            "trimlab.agents.capture, trimlab.agents.ddp_hook, trimlab.agents.workloads as W; "
            "from trimlab.config import WorkloadConfig; W.build(WorkloadConfig(), 1); "
            f"print([m for m in {CONTROLLER_ONLY!r} if importlib.util.find_spec(m)])")
    done = subprocess.run([str(python), "-c", code], cwd=tmp_path, env=_clean_env(tmp_path), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
    helptext = subprocess.run([str(python), "-m", "trimlab.agents.worker", "--help"], cwd=tmp_path,
                              env=_clean_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert helptext.returncode == 0 and "python -m trimlab.agents.worker" in helptext.stdout


def test_the_layers_contract_holds_over_the_source_tree():
    """lint-imports over the sources as tools see them: the strict editable install is a
    tree of links, one plain path per module, so every folder's imports are checked."""
    import trimlab.testbed.cli
    assert Path(trimlab.testbed.cli.__file__).resolve() == ROOT / "testbed" / "cli.py"
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "2 kept, 0 broken" in done.stdout


def test_every_folder_that_holds_files_is_a_listed_package():
    """setuptools ships a data folder without a warning only when it is listed: a new
    folder (a role's templates, a switch OS) must be added to pyproject's packages."""
    import tomllib
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    missing = []
    for package, folder in cfg["package-dir"].items():
        for d in (ROOT / folder).rglob("*"):
            if d.is_dir() and d.name != "__pycache__" and any(f.is_file() for f in d.iterdir()):
                name = ".".join([package, *d.relative_to(ROOT / folder).parts])
                if name not in listed and not any(name.startswith(m + ".") for m in cfg["package-dir"] if m != package
                                                  and m.startswith(package + ".")):
                    missing.append(name)
    assert missing == [], f"add to [tool.setuptools] packages: {missing}"

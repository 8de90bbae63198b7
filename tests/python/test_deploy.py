"""The Kubernetes recipe (deploy/k8s/), checked as far as this machine can without a cluster:

- every manifest validates, strictly (unknown fields refused), against the API schemas of the
  Kubernetes versions named in K8S_VERSIONS, with kubernetes-validate (PyPI, pinned by
  tools/setup.sh into the torch 2 environment, offline: it ships the schemas); a copy with an
  unknown field and one with a wrongly typed field are refused, so the check can fail;
- every container's command is one of ours, and every flag it is given is a flag that command's
  own --help lists (the real binaries and `python -m wsync`), with every $(VAR) defined in its env;
- the engine container asks for a GPU.

Not run here: a cluster, an image build, a GPU (deploy/README.md).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

from conftest import BIN, ROOT

K8S_VERSIONS = ("1.30", "1.33", "1.37")
MANIFESTS = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
PY = os.environ.get("WSYNC_VLLM_PYTHON")


def _validator():
    if not PY or subprocess.run([PY, "-c", "import kubernetes_validate"], capture_output=True).returncode != 0:
        return None
    return [str(pathlib.Path(PY).parent / "kubernetes-validate"), "--strict", "--no-warn"]


def _validate(paths, version):
    cmd = _validator()
    if cmd is None:
        pytest.skip("no kubernetes-validate in the torch 2 environment ($WSYNC_VLLM_PYTHON; tools/setup.sh --torch)")
    return subprocess.run(cmd + ["-k", version] + [str(p) for p in paths], capture_output=True, text=True)


def _containers():
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []):
                yield path.name, doc["metadata"]["name"], c


def test_there_are_manifests():
    assert MANIFESTS, "deploy/k8s/ holds no manifest"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_strictly(version):
    out = _validate(MANIFESTS, version)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "passed" in out.stdout and "did not validate" not in out.stdout, out.stdout


@pytest.mark.parametrize("broken,why", [
    (("          image: your-registry/wsync:latest", "          image: your-registry/wsync:latest\n          gpus: 1"),
     "'gpus' was unexpected"),
    (("replicas: 2 ", "replicas: \"two\" "), "'two' is not of type 'integer'"),
])
def test_a_broken_manifest_is_refused(tmp_path, broken, why):
    path = ROOT / "deploy" / "k8s" / "rollout-engine-with-agent.yaml"
    text = path.read_text()
    assert broken[0] in text, f"the manifest no longer holds {broken[0]!r}: update this test"
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(broken[0], broken[1], 1))
    out = _validate([bad], K8S_VERSIONS[-1])
    assert out.returncode != 0, out.stdout
    assert why in out.stdout + out.stderr, out.stdout + out.stderr


def _help(argv0):
    """The --help text of the command a container runs, from the real binary or module."""
    if argv0[:3] == ["python", "-m", "wsync"]:
        cmd = [sys.executable, "-m", "wsync", "--help"]
    else:
        name = pathlib.Path(argv0[0]).name
        assert argv0[0] == f"/opt/wsync/bin/{name}", f"{argv0[0]}: not where the wsync image installs binaries"
        cmd = [str(BIN / name), "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_every_flag_is_known_to_its_command():
    seen = 0
    for path, owner, c in _containers():
        argv0 = c["command"]
        text = _help(argv0)
        args = c.get("args", [])
        for flag in (a for a in args if a.startswith("--")):
            assert re.search(rf"(^|[\s\[,]){re.escape(flag)}([\s=,\]]|$)", text, re.M), \
                f"{path} {owner}/{c['name']}: {flag} is not a flag of {' '.join(argv0)}"
        defined = {e["name"] for e in c.get("env", [])}
        for a in args:
            for var in re.findall(r"\$\((\w+)\)", a):
                assert var in defined, f"{path} {owner}/{c['name']}: $({var}) is not in its env"
        seen += 1
    assert seen >= 2


def test_the_engine_asks_for_a_gpu():
    engines = [c for _, _, c in _containers() if c["name"] == "engine"]
    assert engines, "no engine container"
    for c in engines:
        assert int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)) >= 1, c

#!/usr/bin/env python3
"""Packs the wsync Python package (python/) into a wheel with the native libraries of an existing
build, without building anything: what tools/python-venv.sh installs into a build's environments
(offline, in seconds), where `pip install ./python` would rebuild the libraries through CMake
(scikit-build-core). The wheel holds what that one does: python/wsync, wsync/_lib/<lib>.so, and
the metadata of python/pyproject.toml (name, the version read from the top-level CMakeLists.txt
with pyproject's own [tool.scikit-build.metadata.version] regex, dependencies, entry points).

    tools/python-wheel.py LIB_DIR OUT_DIR      # prints the wheel's path
"""

import base64
import hashlib
import pathlib
import re
import sys
import sysconfig
import tomllib
import zipfile

LIBS = ("libwsync_trainer_client.so", "libwsync_engine_host.so")


def metadata(pkg: pathlib.Path, project: dict, version: str) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {version}",
             f"Summary: {project['description']}", f"License: {project['license']['text']}",
             f"Requires-Python: {project['requires-python']}"]
    lines += [f"Requires-Dist: {d}" for d in project.get("dependencies", [])]
    for extra, deps in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {d}; extra == "{extra}"' for d in deps]
    lines.append("Description-Content-Type: text/markdown")
    return "\n".join(lines) + "\n\n" + (pkg / project["readme"]).read_text()


def main(lib_dir: str, out_dir: str) -> int:
    pkg = pathlib.Path(__file__).resolve().parents[1] / "python"
    conf = tomllib.loads((pkg / "pyproject.toml").read_text())
    project = conf["project"]
    v = conf["tool"]["scikit-build"]["metadata"]["version"]
    m = re.search(v["regex"], (pkg / v["input"]).read_text(), re.MULTILINE)
    if not m:
        sys.exit(f"python-wheel.py: no version in {pkg / v['input']} ({v['regex']})")
    version = m.group("value")
    files = {}  # path in the wheel -> bytes
    for f in sorted((pkg / "wsync").rglob("*")):
        rel = f.relative_to(pkg)
        if f.is_file() and "__pycache__" not in rel.parts and rel.parts[1] != "_lib":
            files[rel.as_posix()] = f.read_bytes()
    for lib in LIBS:
        src = pathlib.Path(lib_dir) / lib
        if not src.exists():
            sys.exit(f"python-wheel.py: no {src} (build the targets wsync_trainer_client and wsync_engine_host)")
        files[f"wsync/_lib/{lib}"] = src.resolve().read_bytes()
    dist = f"{project['name']}-{version}.dist-info"
    tag = "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")
    files[f"{dist}/METADATA"] = metadata(pkg, project, version).encode()
    files[f"{dist}/WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: wsync tools/python-wheel.py\n"
                              f"Root-Is-Purelib: false\nTag: {tag}\n").encode()
    entry_points = ""
    for group, entries in project.get("entry-points", {}).items():
        entry_points += f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n"
    files[f"{dist}/entry_points.txt"] = entry_points.encode()
    record = ""
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    files[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    wheel = pathlib.Path(out_dir) / f"{project['name']}-{version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            z.writestr(info, data)
    print(wheel)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: tools/python-wheel.py LIB_DIR OUT_DIR")
    sys.exit(main(sys.argv[1], sys.argv[2]))

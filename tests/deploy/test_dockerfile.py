"""The Dockerfile (no Docker engine here): its build argument VARIANT, its pins against
pyproject.toml, its COPY sources against the repository and .dockerignore, and the
paths the manifests expect in the image."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.deploy.dockerfile import (
    ROOT,
    build_args,
    copies,
    image_path_source,
    is_ignored,
    pin,
    pyproject,
    stages,
)


def _torch_step(variant: str) -> subprocess.CompletedProcess:
    """The Dockerfile's torch RUN step under sh, with pip stubbed to print its args."""
    (step,) = [rest for rest in stages()[-1].all("RUN") if '"$VARIANT"' in rest]
    script = 'pip() { echo "pip $*"; }\n' + step
    env = {**build_args(), "PATH": "/usr/bin:/bin", "VARIANT": variant}
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True,
                          timeout=30)


def test_variant_cpu_takes_the_cpu_wheel():
    assert build_args()["VARIANT"] == "cpu"
    out = _torch_step("cpu")
    assert out.returncode == 0, out.stderr
    torch = pin("torch")
    assert out.stdout.split() == ["pip", "install", "--index-url",
                                  "https://download.pytorch.org/whl/cpu", f"torch=={torch}"]


def test_variant_cuda_takes_the_default_wheel():
    out = _torch_step("cuda")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["pip", "install", f"torch=={pin('torch')}"]


def test_unknown_variant_fails_the_build():
    out = _torch_step("rocm")
    assert out.returncode != 0 and "VARIANT must be cpu or cuda" in out.stderr
    assert "pip" not in out.stdout


def test_pins_equal_pyproject():
    args = build_args()
    assert args["TORCH_VERSION"] == pin("torch") == "2.13.0"
    ray = pin("ray")
    assert ray is not None, ("pyproject.toml pins no ray: the image installs "
                             f"ray[default]=={args['RAY_VERSION']} (add ray=={args['RAY_VERSION']}"
                             " to [project].dependencies)")
    assert args["RAY_VERSION"] == ray
    (install,) = [r for r in stages()[-1].all("RUN") if "/tmp/wheels/" in r]
    assert '"ray[default]==${RAY_VERSION}"' in install


def test_copy_sources_exist_and_are_in_the_build_context():
    for stage in stages():
        for sources, _ in copies(stage):
            for source in sources:
                path = ROOT / source
                assert path.exists(), f"COPY {source}: not in the repository"
                assert not is_ignored(source.rstrip("/")), f"COPY {source}: .dockerignored"
                files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
                needed = [f for f in files if f.suffix in (".py", ".json", ".html",
                                                           ".safetensors", ".toml", ".md")]
                for f in needed:
                    rel = f.relative_to(ROOT).as_posix()
                    if "__pycache__" not in rel:
                        assert not is_ignored(rel), f"{rel} is .dockerignored"


def test_wheel_stage_has_every_package_folder():
    (wheel,) = [s for s in stages() if s.name == "wheel"]
    copied = {src.rstrip("/") for sources, _ in copies(wheel) for src in sources}
    folders = set(pyproject()["tool"]["setuptools"]["package-dir"].values())
    assert folders <= copied, f"not copied into the wheel stage: {folders - copied}"
    assert {"pyproject.toml", pyproject()["project"]["readme"]} <= copied
    final = stages()[-1]
    assert any(r.startswith("--from=wheel") for r in final.all("COPY"))
    assert not [s for sources, _ in copies(final) for s in sources if s.rstrip("/") in folders], \
        "no source tree in the final image (it would shadow the installed package)"


def test_entrypoint_user_and_models_dir():
    final = stages()[-1]
    assert [json.loads(e) for e in final.all("ENTRYPOINT")] == [["outrider"]]
    (user,) = final.all("USER")
    assert int(user.split(":")[0]) != 0
    env = " ".join(final.all("ENV"))
    assert "OUTRIDER_MODELS_DIR=/app/models" in env
    assert "OUTRIDER_MODELS_DIR" in (ROOT / "outrider" / "paths.py").read_text()
    for name in ("demo-target", "demo-draft"):
        source = image_path_source(f"/app/models/{name}")
        assert source == ROOT / "models" / name
        assert (source / "config.json").is_file() and (source / "tokenizer.json").is_file()


@pytest.mark.parametrize("path", ["/app/models/nope", "/elsewhere/demo-target"])
def test_image_path_source_refuses_paths_not_in_the_image(path):
    assert image_path_source(path) is None

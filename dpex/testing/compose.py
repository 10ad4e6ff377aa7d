"""deploy/compose without Docker: read a docker-compose file (and its
overrides) as ``docker compose config`` would, and run each service's
command and environment as a pod of dpex.testing.kube (a host of its own
in a network namespace), its volumes and secrets as local directories and
its healthcheck as an exec probe. What Docker itself provides (the image,
the restart policy, the port mappings) is checked as data, not run.
"""
from __future__ import annotations

import os
import re
from typing import Any

_VARIABLE = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def interpolate(text: str, env: dict[str, str]) -> str:
    """``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``, as compose reads them."""
    def one(match: re.Match) -> str:
        name, op, arg, bare = match.groups()
        if bare:
            return env.get(bare, "")
        value = env.get(name)
        if op in (":-", ":?") and not value or op in ("-", "?") and value is None:
            if op.endswith("?"):
                raise KeyError(f"{name}: {arg}")
            return arg
        return value or ""
    return _VARIABLE.sub(one, text)


def _interpolated(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {k: _interpolated(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolated(v, env) for v in node]
    return interpolate(node, env) if isinstance(node, str) else node


def _merged(base: Any, override: Any, key: str = "") -> Any:
    """Compose's merge: mappings key by key, volumes and ports appended, other values replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: _merged(base[k], v, k) if k in base else v for k, v in override.items()}}
    if key in ("volumes", "ports") and isinstance(base, list) and isinstance(override, list):
        return base + [v for v in override if v not in base]
    return override


def load(paths: list[str], env: dict[str, str]) -> dict[str, Any]:
    """The compose project the files make together (later files override earlier ones), interpolated
    with ``env``; the ``x-`` extension keys dropped, as compose drops them."""
    import yaml
    project: dict[str, Any] = {}
    for path in paths:
        with open(path) as f:
            project = _merged(project, yaml.safe_load(f))
    project = {k: v for k, v in project.items() if not k.startswith("x-")}
    return _interpolated(project, env)


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def command(service: dict[str, Any]) -> list[str]:
    cmd = service["command"]
    return ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)


def size(text: str | int) -> int:
    """A compose size (``3gb``, ``512m``, ``64M``, bytes) in bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)b?", str(text).strip().lower())
    if not match:
        raise ValueError(f"not a size: {text!r}")
    return int(float(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match.group(2)])


def workload(service: dict[str, Any], project: dict[str, Any], project_dir: str) -> tuple[dict[str, Any],
                                                                                          dict[str, str]]:
    """The service as a pod spec for dpex.testing.kube.Pods, and its mounts (container path -> local
    path): bind mounts as they are, secrets under /run/secrets; named volumes are the caller's to give."""
    mounts: dict[str, str] = {}
    volume_mounts = []
    for i, volume in enumerate(service.get("volumes", [])):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts[target] = os.path.normpath(os.path.join(project_dir, source))
        volume_mounts.append({"name": f"volume{i}", "mountPath": target})
    for name in service.get("secrets", []):
        secret = os.path.normpath(os.path.join(project_dir, project["secrets"][name]["file"]))
        mounts[f"/run/secrets/{name}"] = secret
        volume_mounts.append({"name": f"secret-{name}", "mountPath": f"/run/secrets/{name}"})
    container = {"name": "main", "command": command(service), "volumeMounts": volume_mounts,
                 "env": [{"name": k, "value": v} for k, v in environment(service).items()]}
    grace = service.get("stop_grace_period", "10s")
    spec = {"terminationGracePeriodSeconds": float(grace.rstrip("s")), "containers": [container]}
    return {"spec": {"template": {"spec": spec}}}, mounts


def probe(service: dict[str, Any]) -> dict[str, Any]:
    """The healthcheck as an exec probe (``CMD`` form: the command itself; ``CMD-SHELL``: through sh)."""
    test = service["healthcheck"]["test"]
    argv = ["sh", "-c", test[1]] if test[0] == "CMD-SHELL" else test[1:]
    timeout = float(str(service["healthcheck"].get("timeout", "30s")).rstrip("s"))
    return {"exec": {"command": argv}, "timeoutSeconds": timeout}

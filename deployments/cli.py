"""`lmserve` command line.

    lmserve serve [CONFIG]   run a Ray Serve config (default: serve_config.yaml), like `serve run`
    lmserve download [NAME]  fetch and convert a model into the cache (default: smollm2)
    lmserve check CONFIG     validate a serve config's models without starting anything
    lmserve render-k8s       copy serve_config.yaml into k8s/rayservice.yaml's serveConfigV2
                             (--check: only say whether they differ)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml


def _serve(args: argparse.Namespace) -> int:
    # Ray Serve's own CLI does the work (local cluster, deploy, logs, Ctrl-C shutdown).
    from ray.serve.scripts import cli as serve_cli

    sys.argv = ["serve", "run", str(args.config)]
    return serve_cli.main(standalone_mode=True) or 0


def _download(args: argparse.Namespace) -> int:
    from engines.model_source import resolve_model_path

    print(resolve_model_path(args.name))
    return 0


def _check(args: argparse.Namespace) -> int:
    from deployments.app import parse_args
    from engines.config import ConfigError

    doc = yaml.safe_load(Path(args.config).read_text())
    try:
        for app in doc.get("applications", []):
            _, configs = parse_args(app.get("args", {}))
            for model_id, cfg in configs.items():
                print(f"{app.get('name')}: {model_id} -> {cfg.model_name_or_path} ({cfg.infer_backend})")
    except ConfigError as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 2
    return 0


def _render_k8s(args: argparse.Namespace) -> int:
    from deployments.rayservice import ManifestError, render_rayservice

    manifest_path = Path(args.manifest)
    manifest = manifest_path.read_text()
    try:
        rendered = render_rayservice(manifest, Path(args.config).read_text())
    except ManifestError as exc:
        print(f"{manifest_path}: {exc}", file=sys.stderr)
        return 2
    if rendered == manifest:
        print(f"{manifest_path}: serveConfigV2 is {args.config}")
        return 0
    if args.check:
        print(f"{manifest_path}: serveConfigV2 differs from {args.config}; run `lmserve render-k8s`", file=sys.stderr)
        return 1
    manifest_path.write_text(rendered)
    print(f"{manifest_path}: serveConfigV2 <- {args.config}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmserve", description="Serve LLMs on Ray Serve with an OpenAI-compatible API.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run a Ray Serve config (default serve_config.yaml)")
    p.add_argument("config", nargs="?", default=os.environ.get("LMSERVE_CONFIG", "serve_config.yaml"))
    p.set_defaults(func=_serve)
    p = sub.add_parser("download", help="fetch and convert a model into $LMSERVE_HOME (default: smollm2)")
    p.add_argument("name", nargs="?", default="smollm2")
    p.set_defaults(func=_download)
    p = sub.add_parser("check", help="validate the models of a serve config")
    p.add_argument("config", nargs="?", default="serve_config.yaml")
    p.set_defaults(func=_check)
    p = sub.add_parser("render-k8s", help="copy a serve config into a RayService manifest's serveConfigV2")
    p.add_argument("--config", default="serve_config.yaml")
    p.add_argument("--manifest", default="k8s/rayservice.yaml")
    p.add_argument("--check", action="store_true", help="exit 1 if they differ, change nothing")
    p.set_defaults(func=_render_k8s)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

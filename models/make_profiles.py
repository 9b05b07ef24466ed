"""Regenerate every shipped estimated profile in models/profiles/: `python -m models.make_profiles`.

Each entry is (file name, model, batch, GPU, options). The CPU-measured
profiles of the small variants are made by the executor's profiler, not here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from models.estimator import estimate

PROFILE_DIR = Path(__file__).parent / "profiles"

SHIPPED: list[tuple[str, str, int, str, dict]] = [
    # the MO-SOS experiment (Wei et al. 2024): Tesla P40 24 GB
    ("vgg19-b144-227-p40.json", "vgg19", 144, "p40", {"image_size": 227}),
    ("unet-b120-256-p40.json", "unet", 120, "p40", {"image_size": 256}),
    # the vDNN case (Rhu et al. 2016): Titan X (Maxwell) 12 GB
    ("vgg16-b256-titanx.json", "vgg16", 256, "titanx", {}),
    ("vgg416-b32-titanx.json", "vgg416", 32, "titanx", {}),
    # a residual network and a transformer on newer GPUs
    ("resnet50-b256-v100.json", "resnet50", 256, "v100", {}),
    ("transformer-b64-h100.json", "transformer", 64, "h100", {"tokens": 1024, "math": "tf32"}),
]


def make(directory: Path = PROFILE_DIR, only: list[str] | None = None) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, model, batch, gpu, options in SHIPPED:
        if only and file_name not in only and model not in only:
            continue
        profile = estimate(model, batch, gpu, **options)
        path = directory / file_name
        path.write_text(profile.to_json(indent=None) + "\n")
        written.append(path)
        print(f"{path}: {profile.name}, {len(profile.nodes)} nodes, {path.stat().st_size // 1024} KiB")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROFILE_DIR, help="directory (default: models/profiles)")
    parser.add_argument("only", nargs="*", help="file names or model names to regenerate (default: all)")
    arguments = parser.parse_args()
    make(arguments.out, arguments.only or None)


if __name__ == "__main__":
    main()

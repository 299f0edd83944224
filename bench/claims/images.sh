#!/usr/bin/env bash
# Two images a user brings, each running a command that needs what the image added, on both
# backends: one built from a Dockerfile (jq, installed from .deb files downloaded here with
# apt-get download: the build itself needs no network), one imported from a `docker save`
# tarball (figlet, built by Docker from the same kind of Dockerfile).
# Usage (root, after scripts/setup.sh): bash bench/claims/images.sh [OUT.json]
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-bench/results/images.json}"
work="$(mktemp -d /tmp/tenon-images-claim.XXXXXX)"
trap 'rm -rf "$work"' EXIT
tenon=.venv/bin/tenon

echo "[images] downloading jq and figlet .debs (apt-get download, nothing installed)"
mkdir -p "$work/jq" "$work/figlet"
(cd "$work/jq" && apt-get download -qq jq libjq1 libonig5 >/dev/null)
(cd "$work/figlet" && apt-get download -qq figlet >/dev/null)
printf 'FROM tenon-base:bookworm\nCOPY *.deb /tmp/debs/\nRUN dpkg -i /tmp/debs/*.deb && rm -rf /tmp/debs\n' \
  >"$work/jq/Dockerfile"
cp "$work/jq/Dockerfile" "$work/figlet/Dockerfile"

echo "[images] tenon image build -f Dockerfile (jq)"
$tenon image build -f "$work/jq/Dockerfile" "$work/jq" --name claim-jq:1
echo "[images] docker build + docker save + tenon image import (figlet)"
docker build -q -t claim-figlet:1 "$work/figlet" >/dev/null
docker save claim-figlet:1 -o "$work/figlet.tar"
docker rmi -f claim-figlet:1 >/dev/null
$tenon image import "$work/figlet.tar" --name claim-figlet:1
$tenon image list

echo "[images] running each on both backends"
.venv/bin/python - "$out" <<'PY'
import asyncio, json, sys, time
from pathlib import Path
from tenon.runtime.open import open_runtime

RUNS = [("claim-jq:1", "echo '{\"tenon\": {\"images\": 2}}' | jq -c .tenon"),
        ("claim-figlet:1", "figlet -f term tenon && command -v figlet")]

async def one(backend: str, image: str, command: str) -> dict:
    async with open_runtime(budget_bytes=2 << 30, backend=backend,
                            state_dir=Path(f"/var/lib/tenon/claim-images-{backend}")) as rt:
        agent = await rt.create_agent(image=image)
        start = time.perf_counter()
        result = await agent.run(command, timeout=120)
        wall = time.perf_counter() - start
        await agent.close()
    print(f"  {backend:8} {image:16} exit {result.exit_code}  {result.output.strip()!r}")
    return {"backend": backend, "image": image, "command": command,
            "exit_code": result.exit_code, "output": result.output, "first_run_s": round(wall, 3)}

async def main() -> None:
    rows = [await one(b, i, c) for b in ("process", "docker") for i, c in RUNS]
    ok = all(r["exit_code"] == 0 for r in rows)
    Path(sys.argv[1]).write_text(json.dumps({"ok": ok, "runs": rows}, indent=2) + "\n")
    print("[images] all ran" if ok else "[images] FAILED")
    sys.exit(0 if ok else 1)

asyncio.run(main())
PY
$tenon image rm claim-jq:1 >/dev/null
$tenon image rm claim-figlet:1 >/dev/null
rm -rf /var/lib/tenon/claim-images-process /var/lib/tenon/claim-images-docker

#!/usr/bin/env bash
# Sets up everything Tenon needs on a fresh Debian machine (run as root):
# Debian packages, a virtualenv with pinned dependencies, a running dockerd,
# and the built-in images (in the image store /var/lib/tenon/images, and in Docker).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

if [ "$(id -u)" -ne 0 ]; then
  echo "setup: must run as root (cgroups, namespaces and dockerd need it)" >&2
  exit 1
fi

# Debian packages: install only what is missing, so a warm machine starts fast.
pkgs=(mmdebstrap docker.io util-linux iproute2 procps ca-certificates e2fsprogs gcc libseccomp-dev slirp4netns nftables prometheus chromium-headless-shell)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then missing+=(python3-venv); fi
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
  # Debian's prometheus starts a daemon on :9090 and enables it at boot (its recommended
  # node exporter one on :9100): the tests start their own Prometheus on a free loopback
  # port, so none of the package's own may run, now or after a reboot.
  for svc in prometheus prometheus-node-exporter; do
    [[ " ${missing[*]} " == *" prometheus "* && -e "/etc/init.d/$svc" ]] || continue
    if [ -d /run/systemd/system ]; then
      systemctl disable --now "$svc" >/dev/null 2>&1 || true
    else
      service "$svc" stop >/dev/null 2>&1 || true
      update-rc.d "$svc" disable >/dev/null 2>&1 || true
    fi
  done
fi

# Python 3.11 virtualenv with the pinned dependencies.
py=python3.11
command -v "$py" >/dev/null 2>&1 || py=python3
if ! "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "setup: Tenon needs Python 3.11, found $("$py" --version)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$py" -m venv .venv
fi
stamp=.venv/.tenon-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  log "installing Python dependencies (pinned in pyproject.toml)"
  .venv/bin/pip install -q --disable-pip-version-check -e '.[dev,minisweagent]'
  touch "$stamp"
fi

# dockerd with user-namespace remapping: root in a container is the first id of the
# dockremap user's subordinate range on the host, never host root. The setting goes into
# /etc/docker/daemon.json (other keys kept); a daemon this script started is restarted when
# the file changed, one run by systemd is restarted through systemctl.
daemon_json=/etc/docker/daemon.json
mkdir -p /etc/docker
[ -s "$daemon_json" ] || echo '{}' >"$daemon_json"
remap_changed=0
if [ "$(jq -r '."userns-remap" // ""' "$daemon_json")" != default ]; then
  log "enabling userns-remap in $daemon_json"
  jq '. + {"userns-remap": "default"}' "$daemon_json" >"$daemon_json.tmp"
  mv "$daemon_json.tmp" "$daemon_json"
  remap_changed=1
fi
docker_answers() { timeout 5 docker info >/dev/null 2>&1; }
wait_for_dockerd() {
  for _ in $(seq 1 120); do
    timeout 5 docker info --format '{{.SecurityOptions}}' 2>/dev/null | grep -q name=userns && return 0
    sleep 0.5
  done
  echo "setup: dockerd did not come up with userns-remap; see /var/log/tenon-dockerd.log" >&2
  exit 1
}
if [ -d /run/systemd/system ] && systemctl list-unit-files docker.service >/dev/null 2>&1; then
  if [ "$remap_changed" = 1 ] || ! docker_answers; then
    log "restarting docker.service"
    systemctl restart docker
  fi
else
  # dockerd writes its pid to /var/run/docker.pid.
  if [ "$remap_changed" = 1 ] && pid=$(cat /var/run/docker.pid 2>/dev/null) && kill -0 "$pid" 2>/dev/null; then
    log "restarting dockerd (pid $pid) for userns-remap"
    kill "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  fi
  if ! docker_answers; then
    log "starting dockerd (log: /var/log/tenon-dockerd.log)"
    nohup dockerd >>/var/log/tenon-dockerd.log 2>&1 &
  fi
fi
wait_for_dockerd

# Under Docker's remapping every container's user namespace belongs to host root, so the inotify
# instances and watches of all containers also count against host root's per-user limits: each
# container is capped at a share (docker_root.CONTAINER_USER_LIMITS) and the host's limits are
# raised to fit many containers (never lowered; kept across reboots in sysctl.d).
inotify_conf=/etc/sysctl.d/90-tenon-inotify.conf
for setting in fs.inotify.max_user_instances=8192 fs.inotify.max_user_watches=4194304; do
  key="${setting%%=*}" want="${setting#*=}"
  have="$(sysctl -n "$key")"
  if [ "$have" -lt "$want" ]; then
    log "raising $key from $have to $want"
    sysctl -q -w "$setting"
  fi
  grep -qx "$setting" "$inotify_conf" 2>/dev/null || echo "$setting" >>"$inotify_conf"
done

# The process backend's launcher (static; its seccomp filter generated with libseccomp).
log "building the sandbox launcher"
.venv/bin/python -m tenon.sandbox.launcher build >/dev/null
# The tree walker workspace capture and verification stat persistent roots with (static).
log "building the tree walker"
.venv/bin/python -m tenon.host.treewalk build >/dev/null

# The built-in images (tenon-base:bookworm, tenon-python:bookworm): built locally from Debian
# packages with mmdebstrap, never pulled; kept while their package lists hold. They go to the
# image store every runtime shares (/var/lib/tenon/images, or $TENON_IMAGE_DIR) and into
# Docker, where a Dockerfile can start FROM them.
log "ensuring the built-in images"
.venv/bin/tenon image build

#!/usr/bin/env bash
# A local stand-in for python:3.11-slim, for hosts that reach no image registry: Debian's own
# python3 (3.11 on bookworm) from debootstrap, in a venv first on PATH so that `python` and `pip`
# install system-wide as in the official image (Debian's python3 refuses, PEP 668).
#   sudo docker/base.sh [TAG]      (default clipserve-base:bookworm; SUITE, DEBIAN_MIRROR)
# Then: docker build --build-arg BASE_IMAGE=TAG ... (docker/test.sh does both).
set -euo pipefail
tag=${1:-clipserve-base:bookworm}
suite=${SUITE:-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
docker=${DOCKER:-docker}

if "$docker" image inspect "$tag" >/dev/null 2>&1; then
  echo "base.sh: $tag already here"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "base.sh: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
root=$(mktemp -d /var/tmp/clipserve-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
chmod 755 "$root"  # it becomes the image's /: mktemp's 0700 would lock the non-root user out
# minbase: apt, dpkg and the required packages (useradd among them), no init or docs.
nice -n 19 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$suite" "$root" "$mirror"
chroot "$root" python3 -m venv /opt/python
chroot "$root" /opt/python/bin/python -c 'import sys; assert sys.version_info >= (3, 11), sys.version'
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* \
  "$root"/usr/share/man/*
tar -C "$root" -c . | "$docker" import \
  --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python"]' \
  - "$tag"
echo "base.sh: $tag ($("$docker" image inspect -f '{{.Size}}' "$tag") bytes)"

#!/usr/bin/env bash
# Prints a digest of what the compiled extensions are built from (src/ and
# CMakeLists.txt), so that a prebuilt extension can be matched to a tree.
cd "$(dirname "$0")/.."
# LC_ALL=C: the same file order (hence digest) under any locale.
find src CMakeLists.txt -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum |
  cut -c1-16

#!/bin/sh
# consumer.c.pkgconfig: builds a C11 trainer against the installed libferry with pkg-config, as a C
# project would, and runs it.
#   c_consumer.sh PKG_CONFIG CC PKG_CONFIG_DIR SOURCE.c OUT_DIR
set -eu
pkg_config=$1 cc=$2 pc_dir=$3 src=$4 out=$5
PKG_CONFIG_PATH="$pc_dir${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export PKG_CONFIG_PATH
rm -rf "$out"
mkdir -p "$out"
echo "pkg-config ferry: version $("$pkg_config" --modversion ferry): $("$pkg_config" --cflags --libs ferry)"
libdir=$("$pkg_config" --variable=libdir ferry)
# shellcheck disable=SC2046  # pkg-config's output is a list of words
"$cc" -std=c11 -Wall -Wextra -Wpedantic -Werror "$src" $("$pkg_config" --cflags --libs ferry) -lm \
  -Wl,-rpath,"$libdir" -o "$out/c_trainer"
"$out/c_trainer" "$("$pkg_config" --variable=policydir ferry)"

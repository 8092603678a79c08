#!/bin/bash
# usage: mpiexec -n 2 spy_wrap.sh OUTPREFIX FORMAT [py-spy options...] -- python ...
# Ranks listed in $SPY_RANKS (default: 0) record themselves to OUTPREFIX.r$PMI_RANK.<ext>;
# the other ranks run the command unprofiled.
prefix=$1; fmt=$2; shift 2
opts=()
while [ "$1" != "--" ]; do opts+=("$1"); shift; done
shift
case " ${SPY_RANKS:-0} " in *" $PMI_RANK "*) ;; *) exec "$@";; esac
ext=$fmt; [ "$fmt" = chrometrace ] && ext=json; [ "$fmt" = raw ] && ext=txt; [ "$fmt" = speedscope ] && ext=speedscope.json
exec py-spy record --format "$fmt" -o "$prefix.r${PMI_RANK}.$ext" "${opts[@]}" -- "$@"

# shellcheck shell=bash
# Reader of `python -m learner.grpo.resolve` output for the launchers (docs/ALGORITHM.md#grpo-launchers).
#
#   source learner/grpo/read_resolved.sh
#   declare -A CFG
#   out=$(python -m learner.grpo.resolve --config "$config") || exit 2   # config invalid → 2
#   read_resolved CFG <<<"$out"
#   echo "${CFG[SERVER_PORT]}"
#
# Only lines matching ^[A-Z][A-Z0-9_]*= are read; anything else a library printed is ignored. Values are
# shell-quoted by the resolver (Python shlex.quote): a bare safe word or '...' with ' written as '"'"'.
# They are unquoted here WITHOUT eval, and stored in the named associative array, never exported, so a
# stray "PATH=..." line cannot change the environment. Lines whose value is not one quoted word are skipped.
read_resolved() {
  local -n _out="$1"
  local line key val
  local re_line='^([A-Z][A-Z0-9_]*)=(.*)$'
  local re_bare="^[A-Za-z0-9_@%+=:,./-]*$"
  local re_quoted="^'([^']|'\"'\"')*'$"
  while IFS= read -r line || [[ -n $line ]]; do
    [[ $line =~ $re_line ]] || continue
    key=${BASH_REMATCH[1]}
    val=${BASH_REMATCH[2]}
    if [[ $val =~ $re_quoted ]]; then
      val=${val:1:${#val}-2}
      val=${val//\'\"\'\"\'/\'}
    elif ! [[ $val =~ $re_bare ]]; then
      continue
    fi
    _out[$key]=$val
  done
}

# Shell quoting for the launchers' --dry-run output and remote commands
# (sourced, not run).

# $1 as one shell word, quoted only where it needs to be: as is when plain,
# --flag=VALUE with only VALUE quoted, '...' when it has no single quote,
# "..." (escaping \ " $ `) when it has one but no !, else '...' with '\''.
quote() {
  local s="$1"
  if [[ "$s" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$s"
  elif [[ "$s" =~ ^(--[A-Za-z0-9_.-]+=)(.+)$ ]]; then
    printf '%s' "${BASH_REMATCH[1]}"
    quote "${BASH_REMATCH[2]}"
  elif [[ "$s" != *\'* ]]; then
    printf "'%s'" "$s"
  elif [[ "$s" != *'!'* ]]; then
    s="${s//\\/\\\\}"
    s="${s//\"/\\\"}"
    s="${s//\$/\\\$}"
    s="${s//\`/\\\`}"
    printf '"%s"' "$s"
  else
    printf "'%s'" "${s//\'/\'\\\'\'}"
  fi
}

# The arguments as one command line.
words() {
  local out="" word
  for word in "$@"; do
    out="$out $(quote "$word")"
  done
  printf '%s' "${out# }"
}

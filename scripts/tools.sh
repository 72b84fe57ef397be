# The benchmark scripts' checks for the tools a run needs, sourced (by bench-common.sh, and early
# by a script that would otherwise find a tool missing only after its builds). Definitions only.

# need_tcpdump: installs tcpdump when missing (WIRE=1 captures the proxies' loopback traffic) and
# exits when it cannot capture on lo.
need_tcpdump() {
  if ! command -v tcpdump >/dev/null 2>&1; then
    echo "installing tcpdump (WIRE=1 captures the proxies' loopback traffic)" >&2
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq && $sudo apt-get install -y -qq tcpdump >/dev/null
  fi
  if ! grep -q "listening on" <<<"$(timeout 2 tcpdump -Z root -i lo -c 1 -w /dev/null 'tcp port 1' 2>&1)"; then
    echo "WIRE=1 needs to capture on lo (tcpdump as root, or with CAP_NET_RAW)" >&2
    exit 2
  fi
}

#!/usr/bin/env bash
# TLS end to end: certificates made here (a CA and a certificate for 127.0.0.1 signed by it, with
# openssl), then the demo deployment (4 trainer ranks TP2 x EP2 under mpirun, one engine of TP 2)
# with mutual TLS on every gRPC endpoint (coordinator and rendezvous store, rollout agents,
# engines, wsyncctl: tools/wsync-local --tls-dir). Two syncs, each verified bit-exact. Then, with
# everything up, the refusals: a plaintext client, a client without a certificate, a client whose
# certificate another CA signed, and a client that does not trust the servers' CA all fail, on the
# coordinator and on the engine, while the right client still succeeds.
#
#   tests/integration/e2e_tls.sh            (WSYNC_BIN overrides build/bin)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bin="${WSYNC_BIN:-$here/build/bin}"
work="$(mktemp -d /tmp/wsync-e2e-tls.XXXXXX)"
trap 'rm -rf "$work"' EXIT

mkcert() {  # mkcert DIR NAME: DIR/ca.pem and DIR/cert.pem + key.pem for 127.0.0.1, signed by it
  mkdir -p "$1"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj "/CN=$2 test CA" \
    -keyout "$1/ca.key" -out "$1/ca.pem" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=127.0.0.1" \
    -keyout "$1/key.pem" -out "$1/req.pem" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' > "$1/ext.cnf"
  openssl x509 -req -in "$1/req.pem" -CA "$1/ca.pem" -CAkey "$1/ca.key" -CAcreateserial -days 2 \
    -extfile "$1/ext.cnf" -out "$1/cert.pem" 2>/dev/null
  chmod 600 "$1/key.pem" "$1/ca.key"
}
mkcert "$work/tls" wsync
mkcert "$work/rogue" rogue
"$bin/wsync-model-gen" --from-config default --seed 9 --out "$work/hf" > /dev/null
"$bin/wsync-shard" --hf "$work/hf" --out "$work/megatron" --tp 2 --ep 2 --dp 2 > /dev/null

cat > "$work/refusals.sh" <<CHECK
#!/usr/bin/env bash
set -uo pipefail
tls="$work/tls" rogue="$work/rogue" bin="$bin"
CHECK
cat >> "$work/refusals.sh" <<'CHECK'
engine="${WSYNC_ENGINES%% *}"
base=("$bin/wsyncctl" --coordinator "$WSYNC_COORDINATOR" --token-file "$WSYNC_TOKEN_FILE" --timeout 5)
good=(--tls-ca "$tls/ca.pem" --tls-cert "$tls/cert.pem" --tls-key "$tls/key.pem")
fails=0
expect() {  # expect ok|refused WHAT ARGS...: runs wsyncctl status / generate with ARGS
  local want="$1" what="$2"; shift 2
  local out rc=0
  out=$("${base[@]}" "$@" 2>&1) || rc=$?
  if [ "$want" = ok ] && [ "$rc" = 0 ]; then echo "   ok:      $what"
  elif [ "$want" = refused ] && [ "$rc" != 0 ]; then echo "   refused: $what ($(echo "$out" | tail -n1 | cut -c1-110))"
  else echo "   WRONG:   $what: exit $rc: $out"; fails=$((fails + 1)); fi
}
for target in coordinator engine; do
  if [ "$target" = coordinator ]; then cmd=(status); else cmd=(generate --engine "$engine" --prompt 1,2,3 --max-new-tokens 2); fi
  expect ok      "$target: mutual TLS with the deployment's CA"  "${good[@]}" "${cmd[@]}"
  expect refused "$target: plaintext"                              "${cmd[@]}"
  expect refused "$target: TLS without a client certificate"       --tls-ca "$tls/ca.pem" "${cmd[@]}"
  expect refused "$target: a client certificate of another CA"     --tls-ca "$tls/ca.pem" --tls-cert "$rogue/cert.pem" --tls-key "$rogue/key.pem" "${cmd[@]}"
  expect refused "$target: a client that trusts another CA"        --tls-ca "$rogue/ca.pem" --tls-cert "$tls/cert.pem" --tls-key "$tls/key.pem" "${cmd[@]}"
done
[ "$fails" = 0 ] && echo "   every refusal held"
exit "$fails"
CHECK
chmod +x "$work/refusals.sh"
"$here/tools/wsync-local" --source "$work/megatron" --rollout-engines 1 --engine-tp 2 --syncs 2 --hf "$work/hf" \
  --verify --tls-dir "$work/tls" --workdir "$work/run" --then "$work/refusals.sh" | tee "$work/out.txt"
[ "$(grep -c 'bit-exact' "$work/out.txt")" -ge 4 ] || { echo "e2e_tls: the syncs were not verified" >&2; exit 1; }
grep -q "every refusal held" "$work/out.txt"
echo "e2e_tls: ok"

# 5. kernels_tune/ (at 930e74f: 562e7d4's kernels, the TMA option reverted): the launch search over the
#    rank-64 problems and k/v rank 16, the fused dy pass's candidates now searched at q, k/v and gate/up r64
COLORA_TIMEOUT=280 bash scripts/h200.sh cli bench kernels --only tune --tune-budget 240 --out $OUT/kernels_tune > /dev/null 2>&1; grep "^tune" $OUT/cli.log | cut -c1-400

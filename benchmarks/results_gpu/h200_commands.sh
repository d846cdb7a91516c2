# The exact device commands behind docs/benchmarks_gpu.md (run from the repo root on the device, .whl carried).
# Call 1 (288 s):
set -o pipefail; export PYTHONUNBUFFERED=1 FLA_CACHE_RESULTS=1; R=$PWD; L=$OUT/log.txt; S=/tmp/src; C=63a181c
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl >>$L 2>&1 || exit 3
python3 -m pip install -q --no-index --no-deps --target /tmp/skb .whl/scikit_build_core-1.1.2-py3-none-any.whl >>$L 2>&1
export PYTHONPATH=/tmp/site; mkdir -p $S && tar xzf .whl/src.tar.gz -C $S
(nvidia-smi; nproc; python3 -c 'import torch,triton;print(torch.__version__,triton.__version__)'; python3 -m pip show scikit-build-core | head -2) >>$L 2>&1
(cd $S && TORCH_KDA_REQUIRE_EXT=1 CMAKE_BUILD_PARALLEL_LEVEL=12 python3 -m pip install --no-index --no-build-isolation --no-deps . >/tmp/b.log 2>&1 || (cd $S && PYTHONPATH=/tmp/skb:/tmp/site TORCH_KDA_REQUIRE_EXT=1 CMAKE_BUILD_PARALLEL_LEVEL=12 python3 -m pip install --no-index --no-build-isolation --no-deps . >>/tmp/b.log 2>&1); echo build rc=$? >>/tmp/b.log) & BP=$!
cd /tmp; B=$S/benchmarks/bench_gpu.py
python3 $B --parts warm --shapes B1-T8192-H16,B4-T2048-H16 --out $OUT/time >/tmp/w16.log 2>&1 & W1=$!
python3 $B --parts warm --shapes B1-T8192-H96 --out $OUT/time >/tmp/w96.log 2>&1 & W2=$!
wait $BP; tail -25 /tmp/b.log >>$L; echo "build done $SECONDS s" >>$L
python3 -c 'import torch_kda;print(torch_kda.available_backends())' >>$L 2>&1 || export PYTHONPATH=$S:/tmp/site
OMP_NUM_THREADS=4 timeout 300 python3 $B --parts parity --out $OUT/parity --commit $C 2>&1 | tee -a $L | tail -40
wait $W1 $W2; cat /tmp/w16.log /tmp/w96.log >>$L; echo "warm done $SECONDS s" >>$L
timeout $((590-SECONDS)) python3 $B --parts time --out $OUT/time --commit $C 2>&1 | tee -a $L | tail -45
echo "total $SECONDS s" | tee -a $L

# Call 2 (40 s, same machine still warm):
export PYTHONUNBUFFERED=1 FLA_CACHE_RESULTS=1 PYTHONPATH=/tmp/site; L=$OUT/log2.txt; S=/tmp/src; cd /tmp; B=$S/benchmarks/bench_gpu.py; if [ ! -f $B ] || ! python3 -c 'import torch_kda, fla' 2>/dev/null; then echo COLD | tee $L; exit 4; fi; timeout 560 python3 $B --parts time --rounds 10 --reps 10 --ref-reps 3 --out $OUT/time2 --commit 63a181c 2>&1 | tee -a $L | tail -40

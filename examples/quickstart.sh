fp4train compare --model tiny --recipes mxfp4,nvfp4,tib2d --max-steps 50 --seq-len 128 --batch-size 8 --warmup-steps 5 --eval-every 25 --eval-batches 4 --out runs/quickstart
python -m pytest -q         # the test suite (`--runslow` adds the slow checks)

# one recipe (fp4train train --help; or --config run.toml)
fp4train train --model 60m --recipe tib2d --data ../shared/data/enwiki --seq-len 1024 --batch-size 32 --max-steps 640 --lr 1.2e-3 --warmup-steps 64 --out runs/60m-tib2d
# after a crash or Ctrl-C: continue from the last checkpoint
fp4train train --out runs/60m-tib2d --resume
# recipes x seeds on the same model, data order and budget; two runs per GPU; also scored on other text
fp4train compare --model 60m --data ../shared/data/enwiki --recipes mxfp4,nvfp4,tib2d,adahop --seeds 0,1,2 --noise-floor --gpus 0,0,1,1 --eval-data ../shared/data/tinyshakespeare/input.txt --out runs/cmp
# a Hugging Face causal LM from its config (random init), experts quantized too
fp4train train --hf-config my-mixtral/config.json --recipe nvfp4 --data ../shared/data/enwiki --out runs/mixtral
# outlier-pattern maps and every recipe's per-GEMM error
fp4train analyze --model 60m --data ../shared/data/enwiki --steps 200 --out runs/analysis
# a checkpoint's loss on other text; a Hugging Face folder; a sample
fp4train eval --run runs/60m-tib2d --data ../shared/data/tinyshakespeare/input.txt
fp4train export --run runs/60m-tib2d --out hf/60m-tib2d
fp4train generate --run runs/60m-tib2d --prompt "The history of"
# the presets (--show NAME prints one as TOML)
fp4train recipes

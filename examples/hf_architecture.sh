fp4train train --hf-config my-mixtral/config.json --recipe nvfp4 --data enwiki --out runs/mixtral

torchrun --nproc-per-node 2 -m fp4train train --parallel ddp --model 1b --recipe adahop --batch-size 8 --out runs/1b-adahop
torchrun --nproc-per-node 2 -m fp4train train --parallel fsdp --model 1b --recipe tib2d --batch-size 8 --out runs/1b-tib2d
# a comparison whose every run spreads over both GPUs
fp4train compare --parallel ddp --gpus 0,1 --model 1b --recipes adahop --out runs/cmp-1b

import torch, torch.nn as nn, fp4train

x = torch.randn(4, 64)
q = fp4train.quantize(x, "mxfp4", block=32, scale="floor", rounding="nearest")
print(q, (q.dequantize() - x).abs().max())          # packed codes + E8M0 scales, and the error

model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
fp4train.convert(model, "tib2d")                      # swaps nn.Linear in place, same parameters
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss = model(torch.randn(32, 64)).pow(2).mean()
loss.backward(); opt.step()                           # one training step, all three GEMMs in FP4

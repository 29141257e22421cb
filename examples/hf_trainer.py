import torch
import transformers

import fp4train

config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
model = transformers.LlamaForCausalLM(config)
g = torch.Generator().manual_seed(0)
batches = [torch.randint(0, 256, (4, 64), generator=g) for _ in range(4)]
fp4train.calibrate(model, batches, recipe="adahop")  # AdaHOP's patterns from 4 batches, then FP4 layers
print(model.fp4train_conversion.summary())

rows = [{"input_ids": ids, "labels": ids} for b in batches for ids in b]
args = transformers.TrainingArguments(output_dir="out", max_steps=10, per_device_train_batch_size=4,
                                      learning_rate=3e-3, report_to=[], save_strategy="no", use_cpu=True, logging_steps=5)
trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
trainer.train()

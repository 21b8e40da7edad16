"""Job files of the language-model pipeline that the tests run through `shoal train`."""

TINY_CODEGEN_JOB = """
[pipeline]
env_id = "CodeGen-v1"
train_tasks = 16
torch_threads = 1
fit_threads = 1
[pipeline.teacher]
hidden_size = 32
num_layers = 1
num_heads = 2
num_kv_heads = 1
intermediate_size = 64
max_positions = 256
[pipeline.student]
hidden_size = 32
num_layers = 1
num_heads = 2
num_kv_heads = 1
intermediate_size = 64
max_positions = 256
[pipeline.sft]
epochs = 1
[pipeline.distill]
epochs = 1
[pipeline.rl]
steps = 1
prompts_per_step = 2
max_new_tokens = 8
[pipeline.rl.token]
group_size = 2
[pipeline.eval]
tasks = 2
samples = 1
ks = [1]
max_new_tokens = 8
"""
"""CodeGen-v1 with one-layer models and a handful of tasks and steps: all four stages in
seconds."""

"""What a Megatron user imports: schedule hooks, the drop-in dataset builder, the external
dataloader provider, broadcast groups and the pre-launch layout check."""

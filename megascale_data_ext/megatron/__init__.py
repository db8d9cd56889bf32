"""megatron"""

"""udfs"""

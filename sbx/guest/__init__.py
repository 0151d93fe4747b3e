"""sbx.guest"""

for r in 1 2 3 4; do
  python3 drift.py plain 10
  MALLOC_MMAP_THRESHOLD_=134217728 MALLOC_TRIM_THRESHOLD_=789890688 python3 drift.py fused 10
done

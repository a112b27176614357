cd /work/main
T="MALLOC_MMAP_THRESHOLD_=134217728 MALLOC_TRIM_THRESHOLD_=268435456"
H="GLIBC_TUNABLES=glibc.malloc.hugetlb=1"
for rep in 1 2; do
  for c in D T H TH; do
    case $c in D) E="";; T) E="$T";; H) E="$H";; TH) E="$T $H";; esac
    echo "=== rep $rep cond $c ($E)"
    env $E python3 bench/process_spread.py --procs 6 --json /tmp/ps/$c-$rep.json 2>&1 | tail -3
  done
done
echo DONE

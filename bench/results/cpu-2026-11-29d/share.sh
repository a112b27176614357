for f in slow.py slow16.py slow.py slow16.py slow.py slow16.py; do
  OMP_NUM_THREADS=1 saturate doctor --json -- python3 $f 3000 > d.json 2>/dev/null
  python3 -c "
import json,statistics; d=json.load(open('d.json')); m=d['measurements']
w=[x['forward']+x['backward'] for x in m['window_shares']]; print('$f', 'median %.2f%% max %.2f%%' % (100*statistics.median(w), 100*max(w)))"
done

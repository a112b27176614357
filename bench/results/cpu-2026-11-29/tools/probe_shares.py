import json,glob,sys,os
def sh(p,b):
    b1,b2=p["micro_batches"]; t1,t2=p["seconds"]; per=(t2-t1)/(b2-b1); fixed=max(0,t1-per*b1); return fixed/(fixed+per*b)
for d in sorted(glob.glob(sys.argv[1])):
    for f in sorted(glob.glob(d+"/*-doctor.stdout")):
        name=os.path.basename(f).split("-doctor")[0]
        try: j=json.load(open(f))
        except Exception as e: print(os.path.basename(d), name, "no json"); continue
        m=j["measurements"]; s=m.get("scaling"); s1=m.get("scaling_one_thread"); b=m.get("micro_batch")
        busy=(m.get("contention") or {}).get("other_cores")
        fix=j["fixes"][0]["title"][:40] if j["fixes"] else "-"
        a=f"{sh(s,b):.2f}" if s else "none"; c=f"{sh(s1,b):.2f} r{min(s1['ratios']):.2f}-{max(s1['ratios']):.2f}" if s1 else "-"
        print(f"{os.path.basename(d):16} {name:14} {j['verdict']:15} {fix:42} busy={busy if busy is None else round(busy,2)} share={a} one={c}")

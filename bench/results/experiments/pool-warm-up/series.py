import sys,re
rows=[]
for line in open(sys.argv[1]):
    parts=line.split()
    if not parts: continue
    t=float(parts[0]); d={}
    for i in range(1,len(parts)-1,2):
        d[parts[i]]=float(parts[i+1])
    rows.append((t,d))
t0=rows[0][0]
def g(d,pat):
    return sum(v for k,v in d.items() if re.search(pat,k))
prev=None
for t,d in rows:
    lim=g(d,r'admission_limit\{group="dashboard"'); use=g(d,r'admission_in_use\{group="dashboard"')
    rej=g(d,r'rejections_total\{group="dashboard"'); 
    dc=g(d,r'decreases_total\{.*group="dashboard".*cause="core"|decreases_total\{cause="core",group="dashboard"')
    dec={c:g(d,r'decreases_total.*(cause="%s".*group="dashboard"|group="dashboard".*cause="%s")'%(c,c)) for c in ('core','db_pool','both')}
    sat=g(d,r'saturated'); ps=g(d,r'db_pool_queue_standing'); pw=g(d,r'db_pool_waiting')
    print(f"{t-t0:5.1f} lim={lim:5.0f} use={use:4.0f} rej={rej:5.0f} dec c/p/b={dec['core']:.0f}/{dec['db_pool']:.0f}/{dec['both']:.0f} sat={sat:.0f} poolstand={ps:.0f} poolwait={pw:.0f}")

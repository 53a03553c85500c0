"""``GET /dashboard``: one self-contained HTML page (inline CSS and script, no external assets,
no build step) that renders ``/dashboard/data`` and refreshes it every second.

Every rendered number carries a ``data-k`` attribute naming its field, so tools (and the
headless-browser test) can read the page back."""

# ruff: noqa: E501 - the page's markup and script are kept as written

from __future__ import annotations

PAGE = b"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>dynamo-py dashboard</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#0f1720;color:#e6edf3}
header{padding:12px 20px;background:#16202c;display:flex;gap:24px;align-items:baseline}
h1{font-size:18px;margin:0}h2{font-size:15px;margin:18px 0 6px}
main{padding:0 20px 20px}
table{border-collapse:collapse;width:100%;margin-bottom:8px}
th,td{padding:4px 8px;border-bottom:1px solid #2a3644;text-align:right;white-space:nowrap}
th:first-child,td:first-child{text-align:left}th{color:#8b9bb0;font-weight:600}
.bar{display:inline-block;height:8px;background:#3fb950;vertical-align:middle;margin-right:6px}
.ok{color:#3fb950}.bad{color:#f85149}.muted{color:#8b9bb0}
</style></head>
<body>
<header><h1>dynamo-py</h1>
<span>requests <b data-k="requests_total" id="requests_total">-</b></span>
<span class="muted" id="updated">connecting...</span></header>
<main>
<h2>Models</h2>
<table><thead><tr><th>model</th><th>ready</th><th>workers per role</th><th>requests</th>
<th>req/s</th><th>TTFT p50 / p90 / p99 (ms)</th><th>ITL p50 / p90 / p99 (ms)</th></tr></thead>
<tbody id="models"></tbody></table>
<h2>Workers</h2>
<table><thead><tr><th>worker</th><th>model</th><th>role</th><th>dp rank</th>
<th>KV occupancy</th><th>KV blocks</th><th>running</th><th>waiting</th>
<th>router decode blocks</th><th>prefix hit rate</th><th>served</th></tr></thead>
<tbody id="workers"></tbody></table>
<h2>Last routing decisions</h2>
<table><thead><tr><th>time</th><th>request</th><th>model</th><th>worker</th><th>dp rank</th>
<th>overlap blocks</th><th>cost</th><th>outcome</th></tr></thead>
<tbody id="decisions"></tbody></table>
</main>
<script>
"use strict";
function esc(s){return String(s).replace(/[&<>"]/g,c=>({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c]));}
function num(v,d){return v===null||v===undefined?"-":Number(v).toFixed(d);}
function ms(v){return v===null||v===undefined?"-":(v*1000).toFixed(1);}
function pct(v){return v===null||v===undefined?"-":(v*100).toFixed(1)+"%";}
function cell(k,text){return '<td data-k="'+k+'">'+text+'</td>';}
function q3(k,o){return cell(k,ms(o.p50)+" / "+ms(o.p90)+" / "+ms(o.p99));}
function render(d){
  document.getElementById("requests_total").textContent=num(d.requests_total,0);
  document.getElementById("models").innerHTML=d.models.map(m=>'<tr data-model="'+esc(m.name)+'">'+
    cell("name",esc(m.name))+cell("ready",m.ready?'<span class="ok">yes</span>':'<span class="bad">no</span>')+
    cell("roles",Object.entries(m.roles).map(([r,ws])=>esc(r)+": "+ws.length).join(", "))+
    cell("requests_total",num(m.requests_total,0))+cell("request_rate",num(m.request_rate,2))+
    q3("ttft_ms",m.ttft_s)+q3("itl_ms",m.itl_s)+'</tr>').join("");
  document.getElementById("workers").innerHTML=d.workers.map(w=>'<tr data-worker="'+esc(w.worker_id)+'">'+
    cell("worker_id",esc(w.worker_id))+cell("model",esc(w.model))+cell("role",esc(w.role))+
    cell("dp_rank",w.dp_rank)+
    cell("kv_usage",(w.kv_usage===null?"":'<span class="bar" style="width:'+Math.round(w.kv_usage*80)+'px"></span>')+pct(w.kv_usage))+
    cell("kv_total_blocks",num(w.kv_total_blocks,0))+cell("num_running",num(w.num_running,0))+
    cell("num_waiting",num(w.num_waiting,0))+cell("router_active_decode_blocks",num(w.router_active_decode_blocks,0))+
    cell("prefix_hit_rate",pct(w.prefix_hit_rate))+cell("requests_served",w.requests_served)+'</tr>').join("");
  document.getElementById("decisions").innerHTML=d.decisions.map(x=>'<tr>'+
    cell("time",new Date(x.time*1000).toLocaleTimeString())+cell("request_id",esc(x.request_id))+
    cell("model",esc(x.model))+cell("worker_id",esc(x.worker_id))+cell("dp_rank",x.dp_rank===null?"-":x.dp_rank)+
    cell("overlap_blocks",x.overlap_blocks)+cell("cost",num(x.cost,2))+
    cell("outcome",'<span class="'+(x.outcome==="success"?"ok":"bad")+'">'+esc(x.outcome)+'</span>')+'</tr>').join("");
  document.getElementById("updated").textContent="updated "+new Date(d.time*1000).toLocaleTimeString();
  document.body.setAttribute("data-loaded","1");
}
async function tick(){
  try{const r=await fetch("/dashboard/data",{cache:"no-store"});if(r.ok)render(await r.json());
      else document.getElementById("updated").textContent="error "+r.status;}
  catch(e){document.getElementById("updated").textContent="unreachable";}
}
tick();setInterval(tick,1000);
</script>
</body></html>
"""
